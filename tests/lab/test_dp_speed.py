"""On a 50 Mbit/s link between 2 hosts, a PowerSGD (rank 2 + EF) data-parallel step of the
digits MLP is faster than the dense one: the lab's links make bytes cost wall time."""

import json
import pathlib
import sys

import pytest

from jaxcomp import lab

WORKER = pathlib.Path(__file__).with_name("_dp_worker.py")
RATE = 50e6
DENSE_BYTES = 150_794 * 4  # the MLP's float32 parameters

pytestmark = pytest.mark.slow  # 2 JAX processes compile and time both steps


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    with lab.Lab(2, RATE, devices=1) as lb:
        result = lb.run([sys.executable, str(WORKER), str(out / "times.json")], str(out),
                        timeout_s=240)  # fmt: skip
    assert result.ok, [pathlib.Path(p).read_text()[-2000:] for p in result.logs]
    return json.loads((out / "times.json").read_text())


def test_powersgd_step_is_faster_than_dense_at_50mbit(timed):
    dense, psgd = timed["dense"], timed["powersgd"]
    assert dense["bytes"] >= DENSE_BYTES and psgd["bytes"] < DENSE_BYTES / 10
    # the dense step waits for its bytes on the link (a 2-worker ring: n / rate each way) ...
    assert dense["median_s"] >= 0.8 * DENSE_BYTES * 8 / RATE, dense
    # ... and the compressed one does not
    assert psgd["median_s"] < dense["median_s"], (psgd, dense)
