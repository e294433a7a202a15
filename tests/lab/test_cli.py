"""``python -m jaxcomp.lab``: what it says where it cannot build a lab, and the user-namespace
route it takes when not root."""

import os
import shutil
import subprocess
import types

import pytest

from jaxcomp.lab import __main__ as cli
from jaxcomp.lab import _net

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user")


def test_not_root_without_user_namespaces_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: "/usr/bin/" + tool)
    failed = types.SimpleNamespace(returncode=1, stderr="unshare: Operation not permitted\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    assert cli.main(["rate", "--rate", "10mbit"]) == cli.EXIT_SETUP
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "root or unprivileged user namespaces" in err
    assert "Operation not permitted" in err


def test_not_root_inside_its_user_namespace_does_not_recurse(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv(cli.USERNS_FLAG, "1")
    assert cli.main(["check"]) == cli.EXIT_SETUP
    assert capsys.readouterr().err.startswith("error: the network lab needs root")


@root_only
def test_another_user_builds_the_lab_network_in_its_user_namespace():
    """What ``_net.build`` does (namespaces, a veth pair between them, a tbf limit, a host's
    own hostname), done as ``nobody`` inside the prefix the CLI runs itself under."""
    script = (
        "ip netns add h0 && ip netns add hub && "
        "ip link add eth0 netns h0 type veth peer name p0 netns hub && "
        "ip netns exec h0 tc qdisc add dev eth0 root tbf rate 10mbit burst 8192 latency 400ms && "
        "ip netns exec h0 unshare --uts -- sh -c 'hostname 10.64.0.1 && hostname'"
    )
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
         *cli.USERNS_PREFIX, "sh", "-c", script],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10.64.0.1"]


@root_only
def test_check_builds_and_removes_a_network(capsys):
    assert cli.main(["check"]) == 0
    assert capsys.readouterr().out.startswith("ok: this machine builds lab networks (as root)")


@root_only
@pytest.mark.slow  # a subprocess lab, ~3 s
def test_the_user_namespace_route_builds_a_lab_that_honours_its_rate():
    """The whole CLI inside :data:`cli.USERNS_PREFIX` (root there as any user would be; the
    interpreter here lives where another user cannot run it): 2 MB over 20 Mbit/s."""
    before = set(_net.stale_namespaces())  # (another test's live lab may come and go meanwhile)
    done = subprocess.run(
        cli._userns_command(["rate", "--rate", "20mbit", "--bytes", "2000000"]),
        env={**os.environ, cli.USERNS_FLAG: "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    mbit = float(done.stdout.split(" = ")[1].split()[0])
    assert 16 <= mbit <= 24, done.stdout
    assert set(_net.stale_namespaces()) <= before  # it left no namespace behind
