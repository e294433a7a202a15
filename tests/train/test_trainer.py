"""The training loop: resume, non-finite steps, corrupted checkpoints, metrics and summary."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from jaxcomp import train


def _final_params(workdir):
    ckpt = train.Checkpointer(workdir)
    step = ckpt.all_steps()[-1]
    import orbax.checkpoint as ocp

    out = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ckpt.close()
    return step, out["state"]


def test_run_writes_metrics_plot_and_summary(make_config, tmp_path, capsys):
    summary = train.train_and_evaluate(make_config(eval_every=8), str(tmp_path))
    out = capsys.readouterr().out
    assert "summary: dense / mlp" in out and "step 12/12" in out
    # the config's line first, then each program as its compile starts, then the description
    lines = out.splitlines()
    assert lines[0].startswith("jaxcomp: dense | model mlp, data digits, batch 64, 12 steps")
    compiling = [i for i, line in enumerate(lines) if line.startswith("  compiling ")]
    described = next(i for i, line in enumerate(lines) if line.startswith("  wire bytes/step"))
    assert compiling and compiling == list(range(1, len(compiling) + 1)), lines[:8]
    assert described > compiling[-1]
    assert any(line.startswith("  compiling train_step (") for line in lines[1:described])
    for name in ("metrics.jsonl", "train.csv", "eval.csv", "metrics.png", "summary.json"):
        assert (tmp_path / name).exists(), name
    records = train.read_metrics(str(tmp_path))
    assert [r["step"] for r in records if r["split"] == "train"] == [4, 8, 12]
    assert [r["step"] for r in records if r["split"] == "eval"] == [8, 12]
    assert summary["steps"] == 12 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["wire_bytes_per_step"] > 0 and summary["compression_ratio"] == pytest.approx(1)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 12


def test_stop_and_resume_is_bit_identical(make_config, tmp_path, event_files):
    """Also: the resumed run's TensorBoard events hold every scalar of its metrics.jsonl (a
    writer changes no result: ``full`` runs without one)."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train.train_and_evaluate(make_config(), full)
    tb = make_config(writers=("tensorboard",))
    assert train.train_and_evaluate(tb, part, stop_after=6) == {"stopped_at": 6}
    train.train_and_evaluate(tb, part)  # resumes from step 6 (mid-epoch position)
    seen = event_files(part)
    assert seen["summary/final_accuracy"][0][0] == 12 and "train/step_time_s" in seen
    (s1, a), (s2, b) = _final_params(full), _final_params(part)
    assert s1 == s2 == 12
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
    r1 = [r for r in train.read_metrics(full) if r["split"] == "eval"]
    r2 = [r for r in train.read_metrics(part) if r["split"] == "eval"]
    assert r1 == r2


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_corrupted_latest_checkpoint_falls_back_with_a_warning(make_config, tmp_path, caplog):
    workdir = str(tmp_path)
    train.train_and_evaluate(make_config(total_steps=8), workdir)
    ckpt_dir = tmp_path / "checkpoints" / "8" / "state"
    for root, _, files in os.walk(ckpt_dir):
        for f in files:
            if not f.startswith("_"):
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"garbage")
    with caplog.at_level(logging.WARNING):
        summary = train.train_and_evaluate(make_config(total_steps=12), workdir)
    assert "checkpoint step 8" in caplog.text and "falling back" in caplog.text
    assert summary["steps"] == 12


def test_workdir_of_another_experiment_is_refused(make_config, tmp_path):
    train.train_and_evaluate(make_config(total_steps=4), str(tmp_path))
    with pytest.raises(ValueError, match=r"holds a checkpoint of another experiment.*'lr'"):
        train.train_and_evaluate(make_config(total_steps=4, lr=0.5), str(tmp_path))
    # run-length keys may change: continuing the same experiment for longer is allowed
    assert train.train_and_evaluate(make_config(total_steps=8), str(tmp_path))["steps"] == 8


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(make_config, tmp_path):
    config = make_config(optax_name="sgd", lr=1e30, max_nonfinite_in_a_row=3, total_steps=40)
    with pytest.raises(train.NonFiniteError, match="3 training steps in a row"):
        train.train_and_evaluate(config, str(tmp_path))
    records = train.read_metrics(str(tmp_path))
    state_step, state = _final_params(str(tmp_path))
    assert all(np.isfinite(x).all() for x in _leaves(state))  # the last good state was kept
    assert state_step < 40
    shutil.rmtree(tmp_path)
    assert records is not None
