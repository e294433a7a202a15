"""Deliberate one-line mutations of the core, and a runner that shows the suite catches each.

    python tools/mutations.py check                      # every mutation applies exactly once
    python tools/mutations.py run REV OUT.jsonl [--fast] [NAME ...]

``run`` checks ``REV`` out in a scratch worktree (``/tmp/jaxcomp-mutants-<pid>``), and for
each mutation: applies it, runs ``pytest -x`` on the mutation's test files (and
``tests/test_user_numerics.py``, which runs their ``user_numerics`` tests) through
``tools/cpu-slot`` (``--fast``: first with ``-m "not slow"``, the fast tier, then, if that
passes, without), records whether the run failed and the first failing test, and restores the
file. A mutation "caught" is a failing run
of part of the suite, so the whole suite fails on it too; a run that passes names a property
the listed files do not check (list more files, or the suite lost it). One JSON line per
mutation goes to ``OUT.jsonl``.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("JAXCOMP_PYTHON", "/work/main/.venv/bin/python")
#: the test that runs the listed files' ``user_numerics`` tests with XLA:CPU's fusion emitters
#: (the other pytest processes deselect them: tests/conftest.py); added to every run
RUNNER = "tests/test_user_numerics.py"

#: name: (file, old line fragment (exactly once in the file), new fragment, test paths). Where
#: a change since moved the line, ``file``, ``old`` and ``new`` are tuples of alternatives, one
#: per layout: the first whose file exists in the revision and holds its fragment once applies.
MUTATIONS = {
    "quantize_decode_scale": (
        "jaxcomp/compressors/_quantize.py",
        "x_hat = (q - half) / half * s",
        "x_hat = (q - half) / levels * s",
        ["tests/compressors/test_quantize.py"],
    ),
    "quantize_clip_off_by_one": (
        "jaxcomp/compressors/_quantize.py",
        "-half, half - 1.0) + half",
        "-half, half) + half",
        ["tests/compressors/test_quantize.py", "tests/compressors/test_magnitudes.py"],
    ),
    "ef_residual_sign": (
        "jaxcomp/feedback/_error_feedback.py",
        "return decayed(corrected - decoded, decay)",
        "return decayed(decoded - corrected, decay)",
        ["tests/feedback/test_channels.py"],
    ),
    "ef_dropped_residual": (
        "jaxcomp/feedback/_error_feedback.py",
        "corrected = x + e.astype(x.dtype)",
        "corrected = x + 0 * e.astype(x.dtype)",
        ["tests/feedback/test_channels.py"],
    ),
    "ef21_mean_dropped_term": (
        "jaxcomp/feedback/_ef21.py",
        "mean = memory.mean.astype(x.dtype) + mean_delta",
        "mean = mean_delta",
        ["tests/feedback/test_reduction_reference.py", "tests/transforms/test_compressed_mean.py"],
    ),
    "accordion_threshold_flipped": (
        ("jaxcomp/_critical.py", "jaxcomp/_regime.py"),
        "return jnp.logical_or(first, jnp.logical_not(ratio < eta))",
        "return jnp.logical_or(first, ratio < eta)",
        ["tests/transforms/test_accordion.py", "tests/pipeline/test_adaptive.py"],
    ),
    "accordion_first_interval": (
        ("jaxcomp/_critical.py", "jaxcomp/_regime.py"),
        "ratio = jnp.where(prev_norm != 0, jnp.abs(prev_norm - norm) / safe, 9.0)",
        "ratio = jnp.where(prev_norm != 0, jnp.abs(prev_norm - norm) / safe, 0.0)",
        ["tests/transforms/test_accordion.py", "tests/pipeline/test_adaptive.py"],
    ),
    "ab_schedule_off_by_one": (
        ("jaxcomp/transforms/_ab_schedule.py", "jaxcomp/ab/_schedule.py"),
        "cycle = jnp.where(count % self.sync_every < self.full_rank_steps, ABPhase.FULL, "
        "ABPhase.AB)",
        "cycle = jnp.where(count % self.sync_every <= self.full_rank_steps, ABPhase.FULL, "
        "ABPhase.AB)",
        [
            "tests/transforms/test_ab_schedule.py",
            "tests/transforms/test_ab_training.py",
            "tests/ab/test_schedule.py",
            "tests/ab/test_transform.py",
        ],
    ),
    "ab_sync_skipped": (
        ("jaxcomp/transforms/_ab_sync.py", "jaxcomp/ab/_sync.py"),
        "        a, b = topo.sync_mean((a, b))",
        "        a, b = a, b",
        [
            "tests/transforms/test_ab_sync.py",
            "tests/transforms/test_ab_training.py",
            "tests/ab/test_sync.py",
            "tests/ab/test_transform.py",
        ],
    ),
    "pipeline_send_direction": (
        ("jaxcomp/pipeline/_ticks.py",) * 3,
        (
            "pairs = [(b + 1, b)] if reverse else [(b, b + 1)]",
            "pairs = [(b + 1, b) if reverse else (b, b + 1) for b in boundaries]",
            "fwd = tuple((b, b + 1) for b in range(num - 1) if kinds[b] == F)",
        ),
        (
            "pairs = [(b, b + 1)] if reverse else [(b + 1, b)]",
            "pairs = [(b, b + 1) if reverse else (b + 1, b) for b in boundaries]",
            "fwd = tuple((b + 1, b) for b in range(num - 1) if kinds[b] == F)",
        ),
        ["tests/pipeline/test_gpipe.py"],
    ),
    "1f1b_schedule_off_by_one": (
        ("jaxcomp/pipeline/_schedule.py", "jaxcomp/pipeline/_schedule.py"),
        (
            "times = {(FORWARD, m, s): 2 * m + s for m in range(m_) for s in range(s_)}",
            "forward=lambda m, s, S, M: 2 * m + s,",
        ),
        (
            "times = {(FORWARD, m, s): 2 * m + s + 1 for m in range(m_) for s in range(s_)}",
            "forward=lambda m, s, S, M: 2 * m + s + 1,",
        ),
        ["tests/pipeline/test_schedule.py", "tests/pipeline/test_gpipe.py"],
    ),
    "rand_k_unbiased_scale": (
        "jaxcomp/compressors/_rand_k.py",
        "vals = vals * sizes.astype(vals.dtype)",
        "vals = vals * (sizes - 1).astype(vals.dtype)",
        ["tests/compressors/test_sparse.py"],
    ),
    "power_sgd_no_orthogonalize": (
        ("jaxcomp/compressors/_low_rank.py", "jaxcomp/compressors/_power_sgd.py"),
        (
            "p = orthogonalize(m @ q_scaled, epsilon)",
            "p = _low_rank.orthogonalize(m @ q_scaled, epsilon)",
        ),
        ("p = m @ q_scaled", "p = m @ q_scaled"),
        ["tests/compressors/test_low_rank.py"],
    ),
    "sign_scale_not_mean": (
        "jaxcomp/compressors/_sign.py",
        "    s = jnp.mean(jnp.abs(xf))\n",
        "    s = jnp.max(jnp.abs(xf))\n",
        ["tests/compressors/test_contract.py", "tests/compressors/test_magnitudes.py"],
    ),
    "decode_mean_sum_not_mean": (
        "jaxcomp/comm/_reduce.py",
        "return (total / num).astype(like.dtype)",
        "return total.astype(like.dtype)",
        ["tests/comm/test_reduce.py", "tests/transforms/test_compressed_mean.py"],
    ),
    "detector_lr_drop_direction": (
        ("jaxcomp/pipeline/_detector.py", "jaxcomp/pipeline/_adaptive.py"),
        "mode = jnp.where(nxt < now, LOW_COMPRESSION, mode)",
        "mode = jnp.where(nxt < now, HIGH_COMPRESSION, mode)",
        ["tests/pipeline/test_adaptive.py"],
    ),
    "non_finite_step_committed": (
        "jaxcomp/train/_mode.py",
        "return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)",
        "return new",
        ["tests/train/test_nonfinite.py", "tests/train/test_modes.py", "tests/test_faults.py"],
    ),
    "loader_resume_position": (
        "jaxcomp/data/_loader.py",
        "return batch, LoaderState(epoch, index + 1)",
        "return batch, LoaderState(epoch, index + 1 if index else 2)",
        ["tests/data/test_sources_and_loader.py", "tests/train/test_trainer.py"],
    ),
    "bitpack_field_shift": (
        "jaxcomp/compressors/_bitpack.py",
        "byte = byte | (field[j] << (j * width))",
        "byte = byte | (field[j] << (j * width + 1))",
        ["tests/compressors/test_quantize.py"],
    ),
    # three that only user_numerics tests catch (run with the fusion emitters: tests/conftest.py)
    "finite_sum_not_zeroed": (
        "jaxcomp/_finite.py",
        "zeros = [jnp.sum(jnp.concatenate(g) * 0) for g in groups]",
        "zeros = [jnp.sum(jnp.concatenate(g)) for g in groups]",
        ["tests/test_finite.py"],
    ),
    "quantize_no_shrink": (
        "jaxcomp/compressors/_quantize.py",
        "jnp.where(s > _SHRINK_ABOVE, 1.0 / _SHRINK_ABOVE, 1.0)",
        "jnp.where(s > _SHRINK_ABOVE, 1.0, 1.0)",
        ["tests/compressors/test_magnitudes.py"],
    ),
    "bits_moved_as_floats": (
        "jaxcomp/_bits.py",
        "    if not any(c is not None for c in carriers):",
        "    if True:",
        ["tests/test_bits.py"],
    ),
    "absmax_fold_drops_nan": (
        "jaxcomp/compressors/_checks.py",
        "folded = jnp.maximum(a[:h], a[h : 2 * h])",
        "folded = jnp.fmax(a[:h], a[h : 2 * h])",
        ["tests/compressors/test_nonfinite.py"],
    ),
    "ef_reduction_decay_dropped": (
        "jaxcomp/feedback/_error_feedback.py",
        "e_new = _cpu.after(new_residual(c, echo[None], decay), mean)",
        "e_new = _cpu.after(new_residual(c, echo[None], 1.0), mean)",
        ["tests/feedback/test_reduction_bits_dense_echo.py"],
    ),
    "stop_signal_not_saved": (
        "jaxcomp/train/_trainer.py",
        "agreed by _health\n            save(step)\n",
        "agreed by _health\n",
        ["tests/test_faults.py"],
    ),
    "checkpoint_checksum_ignored": (
        "jaxcomp/train/_checkpoint.py",
        "wrong = [p for p, a, b in zip(_integrity.leaf_paths(state), sums, saved) if a != b]",
        "wrong = [p for p, a, b in zip(_integrity.leaf_paths(state), sums, sums) if a != b]",
        ["tests/test_faults.py"],
    ),
}


def _alternatives(name: str) -> list[tuple[str, str, str]]:
    path, old, new, _ = MUTATIONS[name]
    if isinstance(path, str):
        return [(path, old, new)]
    old = old if isinstance(old, tuple) else (old,) * len(path)
    new = new if isinstance(new, tuple) else (new,) * len(path)
    return list(zip(path, old, new))


def _locate(tree: pathlib.Path, name: str) -> tuple[str, str, str]:
    """The ``(file, old, new)`` of the mutation in ``tree``'s layout."""
    for path, old, new in _alternatives(name):
        if (tree / path).exists() and (tree / path).read_text().count(old) == 1:
            return path, old, new
    raise ValueError(f"{name}: no alternative applies exactly once in {tree}")


def _apply(tree: pathlib.Path, name: str) -> tuple[str, str]:
    """Applies the mutation; returns ``(file, original text)``."""
    path, old, new = _locate(tree, name)
    text = (tree / path).read_text()
    (tree / path).write_text(text.replace(old, new))
    return path, text


def check() -> int:
    bad = 0
    for name, (_, _, _, tests) in MUTATIONS.items():
        missing = [t for t in tests if not (ROOT / t).exists()]
        try:
            _locate(ROOT, name)
        except ValueError as e:
            print(e)
            bad += 1
        if len(missing) == len(tests):
            print(f"{name}: none of its test files exists")
            bad += 1
    print(f"{len(MUTATIONS)} mutations, {bad} bad")
    return 1 if bad else 0


def _first_failure(out: str) -> str | None:
    """The first failing test; inside the user_numerics runner's run where that failed."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    inner = re.search(r"^E\s+(?:FAILED|ERROR) (\S+)", out, re.M)
    if m and m.group(1).startswith(RUNNER) and inner:
        return inner.group(1)
    return m.group(1) if m else None


def run(rev: str, out_path: str, fast: bool, names: list[str]) -> int:
    tree = pathlib.Path(f"/tmp/jaxcomp-mutants-{os.getpid()}")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)  # fmt: skip
    try:
        for name in names or list(MUTATIONS):
            tests = [t for t in MUTATIONS[name][3] if (tree / t).exists()]  # this revision's
            if (tree / RUNNER).exists():  # runs the files' user_numerics tests
                tests.append(RUNNER)
            path, original = _apply(tree, name)
            # --fast: the fast tier first, and the full files only if it misses
            for tier in ("fast", "full") if fast else ("full",):
                cmd = [str(ROOT / "tools" / "cpu-slot"), "env", f"PYTHONPATH={tree}", PYTHON,
                       "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]  # fmt: skip
                if tier == "fast":
                    cmd += ["-m", "not slow"]
                start = time.time()
                proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
                tail = proc.stdout.strip().splitlines()[-1:] or [""]
                row = {"mutation": name, "rev": rev, "tier": tier, "rc": proc.returncode,
                       "caught": proc.returncode == 1, "first_failure": _first_failure(proc.stdout),
                       "summary": tail[0], "seconds": round(time.time() - start, 1)}  # fmt: skip
                print(json.dumps(row), flush=True)
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if row["caught"]:
                    break
            (tree / path).write_text(original)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "check":
        sys.exit(check())
    args = [a for a in sys.argv[2:] if a != "--fast"]
    sys.exit(run(args[0], args[1], "--fast" in sys.argv, args[2:]))
