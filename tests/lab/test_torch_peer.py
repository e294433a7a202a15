"""The torch peer (``jaxcomp.lab._torch_peer``): DDP over gloo trains the digits MLP on shares
of the trainer's global batch; needs the optional ``peers`` extra (torch)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxcomp.study import _network

# found, not imported: importing torch costs every pytest process ~1.4 s at collection, and
# only the peer's own subprocesses use it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peer(out, ranks, hook="dense", steps=3):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "JAXCOMP_LAB"))}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-m", "jaxcomp.lab._torch_peer", "--hook", hook, "--steps", str(steps),
         "--skip", "1", "--ranks_per_host", str(ranks), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out / "summary.json") as f:
        return json.load(f)


@pytest.mark.slow  # two torch subprocesses, ~12 s
def test_two_ranks_on_halves_of_the_batch_train_as_one_rank_on_all_of_it(tmp_path):
    """DDP averages the ranks' mean gradients, so 2 ranks of 64 examples reach the weights of
    1 rank of 128 (the test loss after 3 Adam steps), and rank 0's step times are in the
    trainer's format (read by the lab's report)."""
    one = _peer(tmp_path / "one", 1)
    two = _peer(tmp_path / "two", 2)
    assert (one["world"], one["batch_per_rank"]) == (1, 128)
    assert (two["world"], two["batch_per_rank"]) == (2, 64)
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert one["test_loss"] < one["test_loss_before"] - 0.01  # it trains
    st = _network.step_times(str(tmp_path / "two"))
    assert st["n"] == 1 and st["left_out"] == [1, 2] and st["median_s"] > 0
