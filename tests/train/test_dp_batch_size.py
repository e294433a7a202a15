"""data_parallel mode with ``transform="accordion_batch_size"`` (Accordion's batch-size variant)."""

import json
import os

import pytest

from jaxcomp import train
from jaxcomp.study import _report

pytestmark = pytest.mark.usefixtures("fast_compiles")


def dp_config(**data_parallel):
    c = train.with_defaults(
        {
            "mode": "data_parallel",
            "mesh": [("data", 8)],
            "model_name": "mlp",
            "model": {"hidden": (16,)},
            "data_name": "digits",
            "batch_size": 64,
            "eval_batch_size": 120,
            "optax_name": "sgd",
            "optax": {"momentum": 0.9},
            "lr": 0.05,
            "total_steps": 6,
            "log_every": 1,
            "eval_every": 0,
            "checkpoint_every": 0,
            "data_parallel": data_parallel,
        }
    )
    return c


def train_records(config, workdir):
    summary = train.train_and_evaluate(config, str(workdir))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return summary, [r for r in records if r.get("split") == "train"]


@pytest.mark.slow
def test_one_micro_batch_per_update_equals_compressed_mean(tmp_path):
    """small = large = 1, identity codec: the same steps as a dense compressed_mean."""
    ref, ref_rec = train_records(
        dp_config(transform="compressed_mean", codec="identity"), tmp_path / "ref"
    )
    got, rec = train_records(
        dp_config(transform="accordion_batch_size", codec="identity", small_steps=1,
                  large_steps=1),
        tmp_path / "bs",
    )  # fmt: skip
    assert [r["loss"] for r in rec] == pytest.approx([r["loss"] for r in ref_rec], rel=1e-6)
    assert [r["wire_bytes"] for r in rec] == [r["wire_bytes"] for r in ref_rec]
    assert all(r["every_k"] == 1 for r in rec)
    assert got["final_accuracy"] == pytest.approx(ref["final_accuracy"], abs=1e-6)


@pytest.mark.slow
def test_a_large_batch_sends_only_on_its_update_steps(tmp_path):
    summary, rec = train_records(
        dp_config(transform="accordion_batch_size", codec="identity", small_steps=2,
                  large_steps=2),
        tmp_path,
    )  # fmt: skip
    sent = [r["wire_bytes"] for r in rec]
    assert len(sent) == 6 and all(r["every_k"] == 2 for r in rec)
    assert sent[0::2] == [0.0] * 3 and min(sent[1::2]) > 0  # an update every 2nd micro-batch
    # the update's collectives sit in a branch: the HLO counts them once, the study report
    # scales them to the run's mean, half of the steps (less the loss/accuracy means' 8 B)
    recs = summary["collectives"]
    branched = sum(r["bytes_per_execution"] * r["executions"] for r in recs if r["conditional"])
    assert branched >= max(sent)
    colls, _ = _report.collectives_of(_report.Run("c", "v", {}, 0, "done", summary, [], [], {}))
    scaled = [c.executions / r["executions"] for c, r in zip(colls, recs) if r["conditional"]]
    assert scaled == pytest.approx([0.5] * len(scaled), abs=0.01)


def test_bad_batch_size_settings_are_setup_errors(tmp_path):
    bad = dp_config(transform="accordion_batch_size", small_steps=4, large_steps=2)
    with pytest.raises(ValueError, match=r"large_steps \(2\) must be >= small_steps \(4\)"):
        train.train_and_evaluate(bad, str(tmp_path))
    bad = dp_config(transform="accordion_batch_size", lr_scaling="cubic")
    with pytest.raises(ValueError, match="lr_scaling"):
        train.train_and_evaluate(bad, str(tmp_path / "b"))
