"""Metric writers: TensorBoard event files hold what metrics.jsonl holds, read back by
tensorboard's own reader; W&B in offline mode where it is installed."""

import importlib.util

import jax
import pytest

from jaxcomp import compressors
from jaxcomp import models
from jaxcomp import train
from jaxcomp import transforms
from jaxcomp.train import _ab_mode
from jaxcomp.train import _dp_mode
from jaxcomp.train import _metrics
from jaxcomp.train import _mode
from jaxcomp.train import _writers


def test_check_names_writers_and_extras(monkeypatch):
    assert _writers.check(None) == () and _writers.check("tensorboard") == ("tensorboard",)
    assert _writers.check(["tensorboard", "tensorboard"]) == ("tensorboard",)
    with pytest.raises(ValueError, match=r"unknown writer 'tb'; allowed are \['tensorboard'"):
        _writers.check(("tb",))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboardX" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'jaxcomp\[tensorboard\]'"):
        _writers.check(("tensorboard",))


def test_resumed_writer_purges_the_interrupted_attempts_later_steps(tmp_path, event_files):
    """An attempt that wrote steps 1-4 and was killed after its checkpoint at 2: the resumed run
    writes 3-4 again, and TensorBoard shows each step once, with the new values."""
    first = train.MetricWriter(str(tmp_path), writers=("tensorboard",))
    first.truncate_after(0)
    for step in range(1, 5):
        first.write(step, "train", {"loss": 10.0 + step, "phase": 1, "name": "x"}, 0.5)
    first.close()
    second = train.MetricWriter(str(tmp_path), writers=("tensorboard",))
    second.truncate_after(2)
    for step in (3, 4):
        second.write(step, "train", {"loss": 20.0 + step, "phase": 1, "name": "x"}, 0.25)
    second.write(4, "eval", {"loss": float("nan"), "accuracy": 0.5})
    second.write_summary(4, {"steps": 4, "collectives": [
        {"kind": "all-reduce", "group_size": 8, "bytes_per_execution": 16.0, "executions": 2.0,
         "conditional": False},
        {"kind": "all-reduce", "group_size": 8, "bytes_per_execution": 4.0, "executions": 1.0,
         "conditional": True}]})  # fmt: skip
    second.close()
    seen = event_files(tmp_path)
    assert seen["train/loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert seen["train/step_time_s"] == [(1, 0.5), (2, 0.5), (3, 0.25), (4, 0.25)]
    assert seen["collectives/all-reduce/8"] == [(4, 36.0)] and seen["summary/steps"] == [(4, 4)]
    assert "train/name" not in seen
    # a fresh start in the same workdir removes the earlier run's event files
    third = train.MetricWriter(str(tmp_path), writers=("tensorboard",))
    third.truncate_after(0)
    third.write(1, "train", {"loss": 1.0})
    third.close()
    assert event_files(tmp_path) == {"train/loss": [(1, 1.0)]}


def test_wandb_offline_logs_every_record(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is optional (pip install 'jaxcomp[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = train.MetricWriter(str(tmp_path), writers=("wandb",))
    w.truncate_after(0)
    w.write(1, "train", {"loss": 2.0, "wire_bytes": 16})
    w.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert run_id and list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))


def _digits_params():
    """The digits MLP's parameters as the trainer holds them: one dict per stage."""
    variables = jax.eval_shape(models.mlp().init, jax.random.key(0))
    return _mode.split_variables(variables)[0]


def test_per_layer_metrics_are_named_by_parameter_path_without_the_stage_index():
    """Accordion's ``layer_mode/...`` and AB's ``rank/...`` (and so their TensorBoard tags)
    name a parameter as ``exclude`` and the model's segments do (``fc2/Dense_0/kernel``), not
    by its position in the per-stage tuple (``1/fc2/...``), which a data-parallel run has no
    use for."""
    params = _digits_params()
    codec = compressors.power_sgd(1)
    tx = transforms.accordion(codec, codec, interval_steps=2)
    modes = _dp_mode._layer_modes(jax.eval_shape(tx.init, params))
    assert list(modes) == [f"layer_mode/{s}/Dense_0/kernel" for s in ("fc1", "fc2", "fc3", "head")]
    ranks = _ab_mode.rank_metric_names(params, ("fc1", "head"))
    assert ranks == ("rank/fc2/Dense_0/kernel", "rank/fc3/Dense_0/kernel")
    with pytest.raises(ValueError, match=r"stage index.*'fc1/Dense_0/kernel'"):
        _mode.parameter_name("fc1/Dense_0/kernel")


#: per-step metrics as the version before the per-layer rename wrote them (the stage index in
#: the name) and as this one does; ``rank/3/kernel`` names a segment ``"3"``: never renamed
OLD = {"loss": 1.0, "layer_mode/0/fc1/kernel": 0.0, "rank/1/3/kernel": 4.0, "gone": 7.0}
NEW = {"loss": 3.0, "layer_mode/fc1/kernel": 1.0, "rank/3/kernel": 2.0, "grad_norm/stage_0": 0.5}


def test_a_run_resumed_from_before_a_metric_rename_writes_one_spelling(tmp_path, event_files):
    """metrics.jsonl and train.csv of a run resumed from a checkpoint written before the rename
    (its records, and the steps in its window) hold the current names only, with a column for
    a metric that appears; an old name with no current one is left out and named. TensorBoard
    shows every step under the current names too (the earlier steps written again under them;
    the old event files keep the old tags)."""
    old = train.MetricWriter(str(tmp_path), writers=("tensorboard",))
    old.truncate_after(0)
    for step in (1, 2, 3):
        old.write(step, "train", OLD)
    old.write(2, "eval", {"loss": 2.0})
    old.close()
    resumed = train.MetricWriter(str(tmp_path), writers=("tensorboard",))
    resumed.truncate_after(2)  # resumed at step 2, a checkpoint's window of one step
    window = [{"layer_mode/0/gone/kernel": 1.0, **OLD, "wire_bytes": 10.0}, NEW]
    record, lost = _metrics.window_mean(window, NEW, {"wire_bytes": 20.0})
    assert lost == ["layer_mode/0/gone/kernel"]
    want = {"loss": 2.0, "layer_mode/fc1/kernel": 0.5, "rank/3/kernel": 3.0, "gone": 7.0,
            "wire_bytes": 15.0, "grad_norm/stage_0": 0.5}  # fmt: skip
    assert record == want and list(record) == list(want)
    resumed.write(4, "train", record)
    resumed.close()
    seen = event_files(tmp_path)  # every scalar of metrics.jsonl, at its steps
    assert seen["train/rank/3/kernel"] == [(1, 4.0), (2, 4.0), (4, 3.0)]
    assert seen["train/loss"] == [(1, 1.0), (2, 1.0), (4, 2.0)]  # not written twice
    records = train.read_metrics(str(tmp_path))
    train_keys = [sorted(k for k in r if "/" in k) for r in records if r["split"] == "train"]
    assert train_keys == [["layer_mode/fc1/kernel", "rank/3/kernel"]] * 2 + [
        ["grad_norm/stage_0", "layer_mode/fc1/kernel", "rank/3/kernel"]
    ]
    assert [r["step"] for r in records] == [1, 2, 2, 4]
    rows = (tmp_path / "train.csv").read_text().splitlines()
    assert (
        rows[0] == "step,loss,layer_mode/fc1/kernel,rank/3/kernel,gone,wire_bytes,grad_norm/stage_0"
    )
    assert rows[1:] == ["1,1.0,0.0,4.0,7.0,,", "2,1.0,0.0,4.0,7.0,,", "4,2.0,0.5,3.0,7.0,15.0,0.5"]
    assert (tmp_path / "eval.csv").read_text().splitlines() == ["step,loss", "2,2.0"]
