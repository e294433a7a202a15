"""``--compile_cache``: off on CPU with one warning line (``docs/results/accbug``); where it is
on (``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1`` here, as another backend would run), a warm run loads
every program and computes the same bits as a cold one and a damaged cache entry is compiled
again, never loaded. The cold run is also AB's run beside CPU-busy processes
(``tests/train/test_ab_contention.py``): it trains without a stall (one launch for both)."""

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


STEPS = 6  # smoke's AB schedule: step 0 dense, then every step program, three SVD transitions


def _run(workdir, cache, busy=False):
    """The CLI's AB smoke run; ``busy``: beside ``os.cpu_count()`` CPU-busy processes over its
    steps (test_ab_contention.py: the stall it guards). Returns its stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_EXPLAIN_CACHE_MISSES="1",
               PYTHONUNBUFFERED="1")  # fmt: skip
    env[_cpu.UNSAFE_CPU_COMPILE_CACHE] = "1"  # the cache's plumbing, as on GPU or TPU
    # optimised, as users compile (the split init is two cached programs only so), with XLA:CPU's
    # loop emitters: the runs compare bits with each other, all compiled alike. XLA's
    # rendezvous watchdog logs "may be stuck" when a device waits over 1 s at a collective
    env["XLA_FLAGS"] = (
        "--xla_cpu_use_fusion_emitters=false --xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
    )
    env.pop("JAXCOMP_COMPILE_CACHE", None)
    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", f"{CONFIG}:smoke",
           "--workdir", str(workdir), "--compile_cache", str(cache),
           "--set", f"total_steps={STEPS}"]  # fmt: skip
    spin, procs, seen = "while True: pass", [], []
    with open(pathlib.Path(workdir).with_suffix(".stderr"), "w+") as err:
        run = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                               text=True)  # fmt: skip
        try:
            for line in run.stdout:
                seen.append(line)
                # the stalls were at the steps' collectives: the busy processes start once the
                # setup has compiled the steps (its last line), so that the compile does not
                # share the cores with them
                if busy and not procs and line.startswith("  wire bytes/step"):
                    procs = [subprocess.Popen([sys.executable, "-c", spin])
                             for _ in range(os.cpu_count() or 2)]  # fmt: skip
                if procs and f"step {STEPS}/{STEPS}" in line:  # the rest runs alone
                    for p in procs:
                        p.kill()
            run.wait(timeout=600)
        finally:
            run.kill()
            for p in procs:
                p.kill()
                p.wait()
        err.seek(0)
        stderr = err.read()
    out = "".join(seen)
    assert run.returncode == 0, out[-2000:] + stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in out, out[-2000:]
    assert procs or not busy, out[-2000:]  # they ran beside every step
    return stderr


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


@pytest.mark.slow  # two CLI processes, the first beside busy ones
def test_a_warm_run_compiles_nothing_and_a_damaged_entry_is_compiled_again(tmp_path):
    # one cache path throughout: JAX's cache key holds the directory's path (its GPU
    # autotuning cache lives inside it), so a copied cache would miss everything
    cache = tmp_path / "cache"
    cold = _run(tmp_path / "cold", cache, busy=True)
    stalls = [line for line in cold.splitlines() if "may be stuck" in line]
    assert not stalls, stalls[:3]  # beside busy processes (test_ab_contention.py)
    summary = json.loads((tmp_path / "cold" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["nonfinite_steps"] == 0
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
