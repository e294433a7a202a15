"""The training loop: corrupted checkpoints, another experiment's workdir, metrics and summary
(resume: test_resume.py; non-finite steps: test_nonfinite.py)."""

import json
import logging
import os

import pytest

from jaxcomp import train

#: messages, files and counts, no bits: unoptimised compiles
pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.mark.usefixtures("curves")
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


@pytest.mark.usefixtures("shared_setups")  # a setup per config
def test_corrupted_latest_checkpoint_falls_back_with_a_warning(make_config, tmp_path, caplog):
    """The newest checkpoint (12) damaged: the run continued to 16 restores 8 and trains
    8 -> 16 (the configs, and setups, of the next test: 12 steps, then 16)."""
    workdir = str(tmp_path)
    train.train_and_evaluate(make_config(total_steps=12), workdir)
    ckpt_dir = tmp_path / "checkpoints" / "12" / "state"
    for root, _, files in os.walk(ckpt_dir):
        for f in files:
            if not f.startswith("_"):
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"garbage")
    with caplog.at_level(logging.WARNING):
        summary = train.train_and_evaluate(make_config(total_steps=16), workdir)
    assert "checkpoint step 12" in caplog.text and "falling back" in caplog.text
    assert "resumed from the older checkpoint step 8" in caplog.text
    assert summary["steps"] == 16


@pytest.mark.usefixtures("shared_setups")  # a setup per config
def test_workdir_of_another_experiment_is_refused(make_config, tmp_path):
    # 12 steps, then 16: the configs (and setups) of the corrupted-checkpoint test
    train.train_and_evaluate(make_config(total_steps=12), str(tmp_path))
    with pytest.raises(ValueError, match=r"holds a checkpoint of another experiment.*'lr'"):
        train.train_and_evaluate(make_config(total_steps=12, lr=0.5), str(tmp_path))
    # run-length keys may change: continuing the same experiment for longer is allowed
    assert train.train_and_evaluate(make_config(total_steps=16), str(tmp_path))["steps"] == 16
