"""Adaptive pipeline links in the trainer: per-boundary modes and bytes in the metrics, and the
detector's config errors (a resume across a link switch: tests/train/test_resume.py)."""

import jax.numpy as jnp
import ml_collections
import pytest

from jaxcomp import train
from jaxcomp.train import _pipeline_mode


def _config():
    c = ml_collections.ConfigDict()
    c.mode = "pipeline"
    c.mesh = [("stage", 2)]  # one boundary, both directions adaptive
    c.model_name = "mlp"
    c.model = dict(hidden=(16,))
    c.data_name = "digits"
    c.data = dict(flat=True)
    c.batch_size = 32
    c.eval_batch_size = 32
    c.optax_name = "adam"
    c.lr = 3e-3
    c.total_steps = 8
    c.log_every = 1
    c.eval_every = 0
    c.checkpoint_every = 0
    c.pipeline = dict(
        num_microbatches=2,
        forward=dict(name="quantize", bits=8, feedback="ef"),
        forward_high=dict(name="quantize", bits=4, feedback="ef"),
        backward=dict(name="quantize", bits=8),
        backward_high=dict(name="quantize", bits=4),
        detector=dict(interval_steps=2, check_every=1),
    )
    return c


@pytest.mark.slow
def test_metrics_log_each_boundary_mode_and_the_bytes_of_that_mode(tmp_path):
    summary = train.train_and_evaluate(_config(), str(tmp_path))
    rows = [r for r in train.read_metrics(str(tmp_path)) if r["split"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    keys = ["link_mode_forward_0", "link_mode_backward_0"]
    modes = [[r[k] for k in keys] for r in rows]
    assert modes[0] == modes[1] == [0] * 2  # the first interval and the decision on it: low
    assert any(v == 1 for m in modes for v in m), modes  # the detector switched some link
    low, high = summary["boundary_bytes_per_step"], summary["boundary_bytes_per_step_high"]
    assert high < low
    for r, m in zip(rows, modes):
        assert r["low_compression_links"] == m.count(0)
        if set(m) == {0}:
            assert r["wire_bytes"] == low
        elif set(m) == {1}:
            assert r["wire_bytes"] == high
        else:
            assert high < r["wire_bytes"] < low


def test_metrics_name_each_adaptive_direction_by_its_boundary():
    """The records of several boundaries (a trainer run above switches one step for all):
    each adaptive direction's own mode under its boundary's number, the fixed ones left out."""
    modes = jnp.array([[0, 1], [1, 0], [1, 1]])
    mask = ((True, True), (True, False), (False, True))
    out = _pipeline_mode._adaptive_metrics({"link_modes": modes, "wire_bytes": 7.0}, mask)
    assert {k: int(v) for k, v in out.items()} == {
        "wire_bytes": 7, "low_compression_links": 1, "link_mode_forward_0": 0,
        "link_mode_backward_0": 1, "link_mode_forward_1": 1, "link_mode_backward_2": 1,
    }  # fmt: skip


def _with_pipeline(**changes):
    c = _config()
    c.pipeline = {**c.pipeline.to_dict(), **changes}  # whole entries replaced, not merged
    return c


@pytest.mark.parametrize(
    "changes, match",
    [
        (  # 1.5 epochs is not a whole number of epochs: never rounded silently
            {"detector": {"interval_epochs": 1.5}},
            r"config.pipeline.detector.interval_epochs must be an integer >= 1; got 1.5",
        ),
        (
            {"detector": {"interval_epochs": 2, "interval_steps": 5}},
            r"config.pipeline.detector: give interval_epochs or interval_steps, not both",
        ),
        ({"detector": {"interval_steps": 0}}, r"detector.interval_steps must be an integer >= 1"),
        ({"detector": {"check_every": 0}}, r"detector.check_every must be an integer >= 1"),
        ({"detector": {"eta": -1.0}}, r"detector.eta must be a number > 0"),
        ({"detector": {"window": 3}}, r"unknown key\(s\) \['window'\] in config.pipeline.detector"),
        (
            {"forward_high": None, "backward_high": None},
            r"config.pipeline.detector is set but no link is adaptive",
        ),
        (
            {"backward_mode": "shared_mask", "backward": None, "backward_high": {"name": "sign"}},
            r"config.pipeline.backward_high: in shared_mask mode",
        ),
    ],
)
def test_bad_detector_config_is_a_clear_error_before_training(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match) as info:
        train.train_and_evaluate(_with_pipeline(**changes), str(tmp_path))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "checkpoints").exists()
