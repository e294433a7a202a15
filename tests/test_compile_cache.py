"""``--compile_cache``: off on CPU with one warning line (``docs/results/accbug``); where it is
on (``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1`` here, as another backend would run), a warm run loads
every program and computes the same bits as a cold one and a damaged cache entry is compiled
again, never loaded."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxcomp import _cpu
from jaxcomp import main

ROOT = pathlib.Path(__file__).parents[1]
CONFIG = str(ROOT / "configs" / "digits_ab.py")  # the mode with the most programs
MISS = "PERSISTENT COMPILATION CACHE MISS"


def _run(workdir, cache):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_EXPLAIN_CACHE_MISSES="1")
    env[_cpu.UNSAFE_CPU_COMPILE_CACHE] = "1"  # the cache's plumbing, as on GPU or TPU
    # optimised, as users compile (the split init is two cached programs only so), with XLA:CPU's
    # loop emitters: the three runs compare bits with each other, all compiled alike
    env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"
    env.pop("JAXCOMP_COMPILE_CACHE", None)
    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", f"{CONFIG}:smoke", "--workdir",
           str(workdir), "--compile_cache", str(cache), "--set", "checkpoint_every=2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def _result(workdir):
    import orbax.checkpoint as ocp

    path = pathlib.Path(workdir) / "checkpoints"
    step = max(int(p.name) for p in path.iterdir() if p.name.isdigit())
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(path / str(step) / "state")
    summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
    return step, summary["final_loss"], [np.asarray(x) for x in jax.tree.leaves(state)]


def _same(a, b):
    assert a[:2] == b[:2] and len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # two CLI processes
def test_a_warm_run_compiles_nothing_and_a_damaged_entry_is_compiled_again(tmp_path):
    # one cache path throughout: JAX's cache key holds the directory's path (its GPU
    # autotuning cache lives inside it), so a copied cache would miss everything
    cache = tmp_path / "cache"
    cold = _run(tmp_path / "cold", cache)
    reference = _result(tmp_path / "cold")
    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    # the three AB step programs, the split init, the evaluation, at least
    assert len(entries) >= 6 and cold.count(MISS) >= len(entries), (entries, cold[-2000:])
    # one flipped byte in the compressed executable of the largest entry (a step program; JAX
    # reads every entry through the same check): the warm run compiles it alone again and
    # loads every other entry (one run for both: a separate warm run cost a CLI launch)
    entry = max(entries, key=lambda p: p.stat().st_size)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    warm = _run(tmp_path / "warm", cache)
    name = entry.name.rsplit("-", 2)[0]
    assert f"Error reading persistent compilation cache entry for '{name}'" in warm, name
    assert warm.count(MISS) == 1, warm[-3000:]
    _same(_result(tmp_path / "warm"), reference)


def test_a_cache_path_that_cannot_be_a_directory_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main.main(["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path / "w"),
                      "--compile_cache", str(blocker / "cache")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --compile_cache") and "cannot be created" in err[0], err


def test_on_cpu_the_cli_turns_the_cache_off_with_one_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(_cpu.UNSAFE_CPU_COMPILE_CACHE, raising=False)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    try:
        main.setup_devices(main.parse_args(["--config", f"{CONFIG}:smoke", "--workdir",
                                            str(tmp_path / "w"), "--compile_cache",
                                            str(tmp_path / "cache")]))  # fmt: skip
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the persistent compilation cache"), err
