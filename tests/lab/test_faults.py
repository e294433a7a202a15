"""Faults in the lab (issue 37, item 6), in one test: a network partition and a straggler.

A partition: one host's link taken down in the middle of a 2-process ``digits_dense`` run. Both
processes exit within the bound (``--peer_timeout``, well under 120 s), non-zero, with one line
each; the last checkpoint stays intact: the workdir the bound left resumes (here, in this
process on 2 of its devices: the newest checkpoint restores, its checksums hold, and the
restored state steps and finishes). A two-process CLI resume end to end, of the workdirs a
``kill -9`` and a full disk leave: tests/test_multihost_faults.py.

A straggler: 3 processes of ``digits_dense``, host 1's link at a tenth of the others' rate (10
vs 100 Mbit/s) both ways, in a second lab. The run finishes, and the link probe
(``config.link_probe_every``, ``train/_link_probe.py``) names host 1 in ``metrics.jsonl`` and in
a log line. Every host's step time is the same (a synchronous step): only the probe tells. (A
2-host link throttled on transmit only: ``test_network.py::test_a_link_honours_its_rate``.)
It runs while the partitioned processes wait out the bound (blocked: the CPU is free), and
ends before the resume starts (its probes time links, best without a compile beside them).

Before (2026-12-04, a loopback taken down at 30 s): both processes aborted 78 s later with exit
134 and a C++ "Check failure stack trace" from JAX's coordination service, no line of ours.
"""

import json
import math
import os
import pathlib
import re
import sys
import threading
import time

import jax
import pytest

from jaxcomp import lab
from jaxcomp import main
from jaxcomp import train
from jaxcomp.lab import _faults

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="builds network namespaces as root"),
    pytest.mark.slow,  # 2- and 3-process trainer runs
    pytest.mark.usefixtures("fast_compiles"),  # the resume here: the lab's runs' compiles
]
ROOT = pathlib.Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "digits_dense.py") + ":smoke"
BOUND = 8  #: --peer_timeout of these runs (s), as tests/test_multihost_faults.py's
SETS = {"mesh": [("data", 2)], "model.hidden": (32, 32, 32), "batch_size": 64,
        "eval_batch_size": 120, "lr": 3e-3, "total_steps": 100_000, "log_every": 5,
        "checkpoint_every": 10, "keep_checkpoints": 2}  # fmt: skip


#: the straggler's run: 3 probes, every 10 steps
EVERY = 10
STRAGGLER = {"model.hidden": (32, 32, 32), "batch_size": 96, "eval_batch_size": 120,
             "total_steps": 3 * EVERY, "log_every": EVERY, "link_probe_every": EVERY,
             "link_probe_bytes": 1 << 18, "mesh": [("data", 3)]}  # fmt: skip


class _Run:
    """The trainer's CLI on every host of ``lb``, in a thread; ``t0``: when it started."""

    def __init__(self, lb, workdir, logs, sets=SETS, bound=BOUND, **more):
        sets = {**sets, **more}
        argv = [sys.executable, "-m", "jaxcomp.main", "--config",
                CONFIG, "--workdir", str(workdir),
                "--cpu_devices", "{devices}",
                *(["--peer_timeout", str(bound)] if bound else []),
                *sum((["--set", f"{k}={v!r}"] for k, v in sets.items()), [])]  # fmt: skip
        env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONUNBUFFERED": "1"}
        self.log0 = logs / "host0.log"
        self.result = None
        self.t0 = time.monotonic()

        def run():
            self.result = lb.run(argv, str(logs), timeout_s=300, env=env, cwd=str(ROOT),
                                 fail_grace_s=150)  # fmt: skip

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def step(self) -> int:
        text = self.log0.read_text() if self.log0.exists() else ""
        steps = re.findall(r"^step\s+(\d+)/", text, re.M)
        return int(steps[-1]) if steps else 0

    def wait_step(self, at: int, timeout=180.0) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < at:
            assert self.thread.is_alive() and time.monotonic() < deadline, self.log0.read_text()
            time.sleep(0.05)

    def wait(self):
        self.thread.join()
        return self.result


def _one_line(path) -> str:
    out = pathlib.Path(path).read_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, out[-3000:]
    assert "Traceback" not in out and "Check failure" not in out, out[-3000:]
    return lines[0]


def _checkpoints(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _check_straggler(result, work, a1) -> None:
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


def test_a_partition_stops_both_hosts_in_the_bound_the_rerun_resumes_a_straggler_is_named(
    tmp_path, capsys
):
    work, slow_work = tmp_path / "run", tmp_path / "straggler"
    with lab.Lab(2, "100mbit", devices=1) as lb, lab.Lab(3, "100mbit", devices=1) as slow:
        _faults.set_rate(slow.net, 1, "10mbit")  # both ways
        run = _Run(lb, work, tmp_path / "logs0")
        try:
            run.wait_step(25)  # checkpoint 10 written, 20 under way or written
        finally:
            _faults.set_link(lb.net, 1, up=False)
        down = time.monotonic() - run.t0
        # the straggler's run goes while the partitioned processes wait out the bound
        straggler = _Run(slow, slow_work, tmp_path / "logs_straggler", STRAGGLER, bound=None)
        result = run.wait()
        after = [e - down for e in result.exited_s]
        assert all(c not in (0, None) for c in result.returncodes), result
        assert max(after) < 120 and min(after) > BOUND - 1, after  # the bound, not at once
        lines = [_one_line(p) for p in result.logs]
        assert result.returncodes == (main.EXIT_PEER_LOST,) * 2, (result, lines)
        said = r"^error: no progress for \d+ s after step \d+ \(the bound, --peer_timeout, "
        assert all(re.search(said + rf"is {BOUND} s\)", x) for x in lines), lines
        a0, a1 = lb.net.addresses
        assert "process 1 (pid" in lines[0] and f"on host {a1}) stopped sending" in lines[0], lines
        assert "process 0 (pid" in lines[1], lines[1]
        assert f"on host {a0}), the coordinator, has not answered" in lines[1], lines[1]
        assert not (work / "checkpoints.damaged").exists()
        last = _checkpoints(work)[-1]
        assert last >= 10

        _check_straggler(straggler.wait(), slow_work, slow.net.addresses[1])
    # the workdir the bound left resumes: its newest checkpoint restored (checksums verified)
    # on the same mesh, 1 process x 2 devices, and stepped to the end
    config = main.load_config(CONFIG)
    sets = [f"{k}={v!r}" for k, v in {**SETS, "total_steps": last + 2}.items()]
    config = train.apply_overrides(config, train.parse_overrides(sets))
    summary = train.train_and_evaluate(config, str(work), devices=jax.devices()[:2])
    out = capsys.readouterr().out
    assert f"resumed from step {last}" in out, out[-3000:]
    assert "the checkpoint was saved by 2 process(es) x 1 cpu" in out, out[-3000:]
    assert math.isfinite(summary["final_loss"]), summary
    assert _checkpoints(work)[-1] == last + 2 and (work / "summary.json").exists()
