"""A straggler host in the lab (issue 37, item 6): processes of ``digits_dense``, host 1's link
at a tenth of the others' rate (10 vs 100 Mbit/s). The run finishes, and the link probe
(``config.link_probe_every``, ``train/_link_probe.py``) names host 1 in ``metrics.jsonl`` and in
a log line. Every host's step time is the same (a synchronous step): only the probe tells.

With 2 hosts a link slow *both* ways slows both directions of the one path between them and
cannot be attributed (``_link_probe.slow_hosts``; a 2-host link throttled on transmit only:
``test_network.py::test_a_link_honours_its_rate``): 3 hosts, host 1's link slow both ways.
"""

import json
import os
import pathlib
import sys

import pytest

from jaxcomp import lab
from jaxcomp.lab import _faults

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="builds network namespaces as root"),
    pytest.mark.slow,  # a 2-process trainer run
]
ROOT = pathlib.Path(__file__).parents[2]
EVERY = 10
SETS = {"model.hidden": (32, 32, 32), "batch_size": 96,
        "eval_batch_size": 120, "total_steps": 3 * EVERY, "log_every": EVERY,
        "link_probe_every": EVERY, "link_probe_bytes": 1 << 18}  # fmt: skip


def test_a_host_whose_link_runs_at_a_tenth_of_the_rate_is_named_and_the_run_finishes(tmp_path):
    hosts = 3
    work = tmp_path / "run"
    sets = {**SETS, "mesh": [("data", hosts)]}
    argv = [sys.executable, "-m", "jaxcomp.main", "--config",
            str(ROOT / "configs" / "digits_dense.py") + ":smoke", "--workdir", str(work),
            "--cpu_devices", "{devices}",
            *sum((["--set", f"{k}={v!r}"] for k, v in sets.items()), [])]  # fmt: skip
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}  # fmt: skip
    with lab.Lab(hosts, "100mbit", devices=1) as lb:
        _faults.set_rate(lb.net, 1, "10mbit")  # both ways
        result = lb.run(argv, str(tmp_path / "logs"), timeout_s=300, env=env, cwd=str(ROOT))
        a1 = lb.net.addresses[1]
    logs = [pathlib.Path(p).read_text() for p in result.logs]
    assert result.ok, (result, [t[-2000:] for t in logs])
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    links = [r for r in records if r["split"] == "links"]
    assert [r["step"] for r in links] == [EVERY, 2 * EVERY, 3 * EVERY], links
    for r in links:  # 256 KiB: 21 ms at 100 Mbit/s, 210 ms at 10 Mbit/s
        fast = r["link_probe_ms/host_2"]  # 2 -> 0
        assert r["link_probe_ms/host_1"] >= 3 * fast, links  # 1 -> 2: out of host 1
        assert r["link_probe_ms/host_0"] >= 3 * fast, links  # 0 -> 1: into host 1
    named = [ln for ln in logs[0].splitlines() if ln.startswith("link probe @")]
    assert len(named) == 3, logs[0][-3000:]
    assert all("host 1 (process 1 (pid " in ln and f"on host {a1})) sends to host 2" in ln
               for ln in named), named  # fmt: skip
    assert (work / "summary.json").exists()
