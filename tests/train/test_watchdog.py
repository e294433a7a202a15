"""Who the watchdog names as lost (``train/_watchdog.py``), from heartbeat ages alone.

The multi-process behaviour (a partition, a killed or stopped peer) is tested end to end in
``tests/lab/test_faults.py`` and ``tests/test_multihost_faults.py``; here the judgement itself,
with the clock's readings set by hand, so that every case is decided the same way under any load.
The case that made the lab test flaky in CI (2026-12-05): the coordinator's process named nobody
because its own key-value calls had also stopped answering by the time the bound fired, although
the peer's heartbeat had stopped well before they did.
"""

import time

import pytest

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
