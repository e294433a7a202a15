"""Who the watchdog names as lost (``train/_watchdog.py``), from heartbeat ages alone.

The multi-process behaviour (a partition, a killed or stopped peer) is tested end to end in
``tests/lab/test_faults.py`` and ``tests/test_multihost_faults.py``; here the judgement itself,
with the clock's readings set by hand, so that every case is decided the same way under any load.
The case that made the lab test flaky in CI (2026-12-05): the coordinator's process named nobody
because its own key-value calls had also stopped answering by the time the bound fired, although
the peer's heartbeat had stopped well before they did.

Last, who reports a failure that both the watchdog and the training loop met: a process SIGSTOPped
past the bound, then continued, printed two ``error:`` lines (the watchdog's "no progress" and the
loop's lost peer, tests/test_multihost_faults.py, 2026-12-05). Each order is forced with events.
"""

import os
import re
import socket
import threading
import time

import pytest

from jaxcomp import main
from jaxcomp import train
from jaxcomp.train import _errors
from jaxcomp.train import _processes
from jaxcomp.train import _trainer
from jaxcomp.train import _watchdog

INTERVAL = 1.0  #: stale after 3 intervals without a change


def _dog(me: int, *, seen: dict[int, float], answered: float):
    """A watchdog of process ``me`` of 2 (on two hosts) whose peer beats changed ``seen[k]``
    seconds ago and whose coordinator last answered ``answered`` seconds ago."""
    team = [_watchdog.Peer(0, 100, "10.0.0.1"), _watchdog.Peer(1, 200, "10.0.0.2")]
    dog = _watchdog.Watchdog(15.0, 69, team, interval_s=INTERVAL)
    dog.me = team[me]
    dog._client = object()
    now = time.monotonic()
    dog._answered = now - answered
    dog._seen = {k: ("beat", now - age) for k, age in seen.items()}
    return dog


def test_a_peer_whose_beats_stopped_while_the_coordinator_answered_is_named():
    dog = _dog(0, seen={1: 10.0}, answered=0.5)
    assert dog._judge() == [
        "process 1 (pid 200 on host 10.0.0.2) stopped sending heartbeats 10 s ago"
    ]


@pytest.mark.parametrize("me", [0, 1])
def test_a_peer_stale_long_before_the_answers_stopped_is_still_named(me):
    other = 1 - me
    dog = _dog(me, seen={other: 15.0}, answered=8.0)  # 7 s of answers after its last beat
    (line,) = dog._judge()
    assert line.startswith(f"process {other} (pid") and "stopped sending heartbeats 15 s" in line


def test_when_everything_stopped_at_once_a_non_coordinator_names_the_coordinator():
    dog = _dog(1, seen={0: 9.0}, answered=9.0)
    assert dog._judge() == [
        "process 0 (pid 100 on host 10.0.0.1), the coordinator, has not answered for 9 s"
    ]


def test_when_everything_stopped_at_once_the_coordinator_says_what_it_saw():
    dog = _dog(0, seen={1: 9.0}, answered=9.0)
    assert dog._judge() == []
    line = dog.lost()
    assert "cannot be told" in line
    assert "this process's own heartbeat calls last answered 9 s ago" in line, line
    assert "process 1's heartbeat last changed 9 s ago" in line, line


def test_a_fresh_peer_is_not_named():
    assert _dog(0, seen={1: 1.0}, answered=0.5)._judge() == []


# --- one error line when the watchdog and the loop both fail ---------------------------------
class _Ended(BaseException):
    """``os._exit`` in these tests: ends the calling thread (the process, were it real)."""


CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "digits_dense.py")


@pytest.mark.parametrize(
    "first, error, code",
    [
        ("watchdog", _errors.PeerLost("a collective failed (gloo: connection reset)"), 69),
        ("loop", _errors.PeerLost("a collective failed (gloo: connection reset)"), 69),
        ("watchdog", _errors.StorageError("cannot write the workdir: no space left"), 69),
    ],
)
def test_the_watchdog_and_the_loop_failing_at_once_give_one_error_line(
    first, error, code, tmp_path, monkeypatch, capfd
):
    """The bound expires while the loop raises: whichever claims the exit first reports (its
    line, its exit code), the other stays silent. ``first="watchdog"``: it is writing its line
    when the loop's error leaves the loop; ``"loop"``: it has found the bound expired and is
    naming the lost process when the loop's error leaves the loop."""
    exits, paused, go = [], threading.Event(), threading.Event()

    def fake_exit(status):
        exits.append(status)
        raise _Ended(status)

    monkeypatch.setattr(os, "_exit", fake_exit)
    hook = threading.excepthook
    monkeypatch.setattr(
        threading, "excepthook", lambda a: None if a.exc_type is _Ended else hook(a)
    )
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main.main appends to it

    def pause():  # the watching thread, at the point the order needs
        paused.set()
        assert go.wait(30)

    host = socket.gethostname()
    team = [_watchdog.Peer(0, os.getpid(), host), _watchdog.Peer(1, 2**30, host)]  # 1: gone
    dogs = []

    def train_and_evaluate(config, workdir, *, stop_after, peer_timeout_s):  # the trainer's
        dog = _watchdog.Watchdog(  # structure around its loop, the loop replaced
            peer_timeout_s, 69, team, on_exit=pause if first == "watchdog" else None
        )
        if first == "loop":
            judge = dog._judge
            watching = lambda: threading.current_thread().name == "jaxcomp-watch"  # noqa: E731
            dog._judge = lambda: (pause(), judge())[1] if watching() else judge()
        dogs.append(dog)
        with _processes.peer_failures_as_lost(lambda: dog.lost(wait_s=3 * dog.interval_s)):
            _trainer._train(None, None, None, dog, *[None] * 6)

    def loop(s, ckpt, lock, dog, *rest):
        dog.start()
        assert paused.wait(30)  # the bound expired: the watchdog is at its pause
        if first == "watchdog":
            go.set()
        raise error

    monkeypatch.setattr(train, "train_and_evaluate", train_and_evaluate)
    monkeypatch.setattr(_trainer, "_loop", loop)
    argv = ["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path), "--peer_timeout", "0.05"]
    try:
        exits.append(main.main(argv))
    except _Ended:
        pass
    (dog,) = dogs
    dog._tick -= 100  # as if this process had been stopped: the silent watchdog's turn keeps it
    go.set()
    for t in dog._threads:
        t.join(30)
        assert not t.is_alive()
    if first == "loop":
        assert "this process did not run for 10" in dog.lost(), dog.lost()
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert set(exits) == {code}, (exits, err)
    said = "no progress for" if first == "watchdog" else "a collective failed"
    assert said in lines[0] and "process 1 (pid 1073741824" in lines[0], lines[0]


def test_a_bound_under_a_second_is_written_as_it_was_given():
    team = [_watchdog.Peer(0, 100, "10.0.0.1")]
    dog = _watchdog.Watchdog(0.4, 69, team, interval_s=0.05)
    dog.me, lines = team[0], []
    dog._exit = lines.append
    dog._last -= 0.6  # no progress for 0.6 s
    dog._watch()
    (line,) = lines
    assert re.search(r"no progress for 0\.\d s .* is 0\.4 s\)", line), line
