"""The lab's network: its links honour their rate, and it leaves nothing behind (after a run
that succeeds, fails, times out, is stopped by a signal, or whose lab is killed)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxcomp import lab
from jaxcomp.lab import __main__ as lab_cli
from jaxcomp.lab import _faults
from jaxcomp.lab import _net

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="builds network namespaces as root")
RATE = 20e6  # low enough that a loaded CPU cannot be what limits it


def _ours(lab_id=None):
    return [n for n in _net.lab_namespaces() if lab_id is None or n.startswith(lab_id)]


@pytest.mark.parametrize("topology", lab.TOPOLOGIES)
def test_a_link_honours_its_rate(topology, tmp_path):
    nbytes = int(RATE / 8 * 0.5)  # 0.5 s at the rate
    with lab.Lab(2, RATE, topology) as lb:
        got = lab.measure_rate(lb, str(tmp_path), nbytes)
        if topology == "per_host":  # one host's link: a NIC throttled on transmit slows only
            _faults.set_rate(lb.net, 1, RATE / 2, direction="out")  # what it sends
            into = lab.measure_rate(lb, _dir(tmp_path / "into"), nbytes)  # host 0 -> host 1
            _faults.set_rate(lb.net, 0, RATE / 2, direction="out")
            out = lab.measure_rate(lb, _dir(tmp_path / "out"), nbytes // 2)
        lab_id = lb.net.lab_id
    assert got["seconds"] == pytest.approx(nbytes * 8 / RATE, rel=0.2), got
    if topology == "per_host":
        assert into["seconds"] == pytest.approx(nbytes * 8 / RATE, rel=0.2), into
        assert out["seconds"] == pytest.approx(nbytes // 2 * 8 / (RATE / 2), rel=0.2), out
    assert not _ours(lab_id)


def _dir(path):
    path.mkdir()
    return str(path)


def test_two_labs_at_once_have_their_own_names_and_addresses():
    with lab.Lab(2, "10mbit") as a, lab.Lab(2, "10mbit") as b:
        assert not set(a.net.namespaces) & set(b.net.namespaces)
        assert not set(a.net.addresses) & set(b.net.addresses)
        assert all(n.startswith(f"{_net.PREFIX}-{os.getpid()}-") for n in a.net.namespaces)
        assert _net.owner_alive(a.net.namespaces[0])
        assert not set(a.net.namespaces) & set(_net.stale_namespaces())  # cleanup spares them
        ids = (a.net.lab_id, b.net.lab_id)
    assert not [n for n in _ours() if n.startswith(ids)]


def test_a_failing_host_stops_the_others_and_a_timeout_stops_all(tmp_path):
    with lab.Lab(3, "10mbit") as lb:
        failed = lb.run(["sh", "-c", 'test "{process_id}" = 1 && exit 3; sleep 60'],
                        str(tmp_path / "f"), timeout_s=60, fail_grace_s=0.5)  # fmt: skip
        slow = lb.run(["sleep", "60"], str(tmp_path / "t"), timeout_s=1)
        namespaces = lb.net.namespaces
        assert not any(_net._pids(n) for n in namespaces)  # every host process is gone
    assert failed.returncodes[1] == 3 and not failed.ok and not failed.timed_out
    assert failed.seconds < 15 and all(c != 0 for c in failed.returncodes)
    assert slow.timed_out and slow.seconds < 15
    assert not set(namespaces) & set(_net.lab_namespaces())


def test_hosts_see_their_own_address_as_hostname(tmp_path):
    with lab.Lab(2, None, devices=3) as lb:
        result = lb.run(["sh", "-c", 'echo "$(hostname) $JAX_PROCESS_ID {devices} $XLA_FLAGS"'],
                        str(tmp_path))  # fmt: skip
        addresses = lb.net.addresses
    lines = [open(p).read().split() for p in result.logs]
    assert [ln[:3] for ln in lines] == [[a, str(i), "3"] for i, a in enumerate(addresses)]
    assert all(ln[-1] == "--xla_force_host_platform_device_count=3" for ln in lines)


LAB_SCRIPT = """
import sys
from jaxcomp import lab
with lab.Lab(2, "10mbit") as lb:
    print(lb.net.lab_id, flush=True)
    lb.run(["sleep", "120"], sys.argv[1], timeout_s=120)
"""


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_lab(tmp_path, preexec_fn=None):
    proc = subprocess.Popen([sys.executable, "-c", LAB_SCRIPT, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn)  # fmt: skip
    lab_id = proc.stdout.readline().strip()
    assert lab_id.startswith(_net.PREFIX), lab_id
    deadline = time.monotonic() + 30
    hosts = []
    while len(hosts) != 2 and time.monotonic() < deadline:  # both hosts started (a host's
        hosts = [p for n in _ours(lab_id) for p in _net._pids(n)]  # launcher may still show)
        time.sleep(0.1)
    assert len(hosts) == 2, hosts
    return proc, lab_id, hosts


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}")]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    "inherited,sig", [("default", signal.SIGTERM), ("sigint_ignored", signal.SIGINT)]
)
def test_a_signalled_lab_tears_itself_down(sig, inherited, tmp_path):
    # a process started with SIGINT ignored (a background job, a test runner's worker) gets no
    # KeyboardInterrupt from Python: the lab installs its own handler. The lab installs its
    # handlers whatever the inherited ones: SIGINT from a default start and SIGTERM with SIGINT
    # ignored take these two cases' paths
    ignore = _ignore_sigint if inherited == "sigint_ignored" else None
    proc, lab_id, hosts = _start_lab(tmp_path, ignore)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0
    assert _gone(hosts) and not _ours(lab_id)


def test_a_killed_lab_leaves_only_namespaces_that_cleanup_removes(tmp_path, capsys):
    proc, lab_id, hosts = _start_lab(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    assert _gone(hosts)  # the kernel killed them with their parent (pdeathsig)
    left = _ours(lab_id)
    assert left and set(left) <= set(_net.stale_namespaces())
    # the CLI's command in this process (`python -m jaxcomp.lab` as a process: test_cli.py)
    assert lab_cli.main(["cleanup"]) == 0
    said = capsys.readouterr().out
    assert all(n in said for n in left), said
    assert not _ours(lab_id)


def test_teardown_kills_only_processes_still_in_its_namespaces(monkeypatch):
    # `ip netns pids` lists pids; one that exits before the kill can be reused by a process
    # elsewhere (pid_max 32768 here): teardown must not kill that stranger
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        with lab.Lab(2, "10mbit") as lb:
            ours = set(lb.net.namespaces)
            monkeypatch.setattr(_net, "_pids", lambda ns: [stranger.pid] if ns in ours else [])
        assert stranger.poll() is None, "teardown killed a process outside its namespaces"
        assert not [n for n in ours if n in _net.list_namespaces()]
    finally:
        stranger.kill()
        stranger.wait()
