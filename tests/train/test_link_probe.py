"""The link probe (``train/_link_probe.py``): its programs on 8 fake devices grouped into 4
fake hosts, the metrics it records and whom it names, from synthetic times.

The probe inside a 3-process run, one host's link at a tenth of the others' rate, is
``tests/lab/test_faults.py`` (its straggler).
"""

import re

import jax
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp.train import _config
from jaxcomp.train import _link_probe
from jaxcomp.train import _watchdog

HOSTS, LOCAL, PAYLOAD = 4, 2, 4096


@pytest.fixture(scope="module")
def probe():
    hosts = np.array(jax.devices()[: HOSTS * LOCAL], dtype=object).reshape(HOSTS, LOCAL)
    return _link_probe.LinkProbe(hosts, PAYLOAD, repeats=1)


def test_each_send_moves_the_payload_from_one_host_to_the_next(probe):
    ids = np.array([[d.id for d in row] for row in probe.mesh.devices])
    for k, send in enumerate(probe.sends):
        text = send.as_text()
        (rec,) = comm.collective_report(text).records
        assert rec.kind == "collective-permute" and rec.bytes_per_execution == PAYLOAD / LOCAL
        pairs = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", text).group(1)
        got = sorted(tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", pairs))
        want = sorted(zip(ids[k].tolist(), ids[(k + 1) % HOSTS].tolist()))
        assert got == want, (k, got)


def test_measure_gives_one_positive_time_per_host(probe):
    times = probe.measure()
    assert times.shape == (HOSTS,) and np.all(np.isfinite(times)) and np.all(times > 0), times
    keys = list(_link_probe.metrics(times))
    assert keys == [f"link_probe_ms/host_{k}" for k in range(HOSTS)]


@pytest.mark.parametrize(
    "times, named",
    [
        ([5.1, 52.0], [1]),  # 2 hosts: host 1 sends at a tenth of the rate
        ([52.0, 5.1], [0]),
        ([5.0, 14.0], []),  # under 3x
        ([5.0, 5.0, 50.0, 5.0], [2]),  # host 2's egress (or 3's ingress)
        ([5.0, 50.0, 50.0, 5.0], [2]),  # host 2's link slow both ways: 1->2 and 2->3
        ([50.0, 5.0, 5.0, 50.0], [0]),  # the same around the ring's end: 3->0 and 0->1
        ([50.0, 50.0, 5.0], [1]),  # 3 hosts, host 1 slow both ways: 2 of 3 sends slow
        ([5.0, 12.0, 6.0, 5.5, 14.0, 5.2, 4.9, 5.1], []),  # noise within 3x
        ([0.0, 0.0], []),
    ],
)
def test_the_named_hosts(times, named):
    assert _link_probe.slow_hosts(times) == named


@pytest.mark.parametrize("times", [[1.0], [1.0, float("nan")], [1.0, -1.0], [[1.0, 2.0]]])
def test_times_that_name_no_one_are_refused(times):
    with pytest.raises(ValueError, match="times must"):
        _link_probe.slow_hosts(times)


def test_the_line_names_the_slow_host_and_its_process():
    team = [_watchdog.Peer(0, 100, "10.0.0.1"), _watchdog.Peer(1, 200, "10.0.0.2")]
    times = [0.0051, 0.052]
    assert _link_probe.metrics(times) == {"link_probe_ms/host_0": 5.1, "link_probe_ms/host_1": 52.0}
    line = _link_probe.describe(40, times, _link_probe.slow_hosts(times), team)
    assert line == (
        "link probe @ 40: slow link: host 1 (process 1 (pid 200 on host 10.0.0.2)) sends to "
        "host 0 in 52.0 ms, 10.2x the others' 5.1 ms."
    )


def test_a_probe_needs_two_hosts_and_a_payload_per_device():
    one = np.array(jax.devices()[:2], dtype=object).reshape(1, 2)
    with pytest.raises(ValueError, match=">= 2 hosts"):
        _link_probe.LinkProbe(one, 4096)
    two = np.array(jax.devices()[:4], dtype=object).reshape(2, 2)
    with pytest.raises(ValueError, match="payload_bytes must be an int >= 8"):
        _link_probe.LinkProbe(two, 4)
    said = []
    assert _link_probe.for_run(10, 4096, jax.devices(), said.append) is None  # one process
    assert said == ["  link probe: off (one process: no link between hosts to time)"]
    assert _link_probe.for_run(0, 4096, jax.devices(), said.append) is None and len(said) == 1


@pytest.mark.parametrize("key, value", [("link_probe_every", -1), ("link_probe_bytes", 100)])
def test_probe_keys_are_checked_before_compiling(key, value):
    config = {"mode": "dense", "mesh": [("data", 1)], "model_name": "mlp", "data_name": "digits",
              "batch_size": 8, "total_steps": 1, key: value}  # fmt: skip
    with pytest.raises(ValueError, match=f"config.{key} must be an integer >= "):
        _config.with_defaults(config)
