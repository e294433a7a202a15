"""The pipeline's cost model on per-host links: the boundary permutes played in program order
(a send waits for its receiver, the chain delay, the token bucket) and its refusals."""

import hypothesis
import pytest
from hypothesis import strategies as st

from jaxcomp.study import _cost
from jaxcomp.study import _moves
from jaxcomp.study import _pipeline_model

send_s = _pipeline_model.pipeline_send_s

LINK = _cost.NetworkLink(bandwidth=1e6, latency=1e-4)


@pytest.mark.parametrize("stages, chain_moves, on_path", [(2, 0, 0), (4, 8, 8), (5, 12, 10)])
def test_only_a_move_whose_receiver_also_sends_pays_the_chain(stages, chain_moves, on_path):
    """GPipe, M=4: a move of one boundary pays nothing more; a move of adjacent boundaries
    (``chain_moves`` of them) delays its upstream sends, which lie on the step's path in
    ``on_path`` of them (S = 5: not in two, whose delayed pair ends before the move's last).
    The program of one permute per boundary has no chains."""
    base = send_s("gpipe", stages, 4, 1e4, LINK)
    chained = send_s("gpipe", stages, 4, 1e4, LINK, chain_s=1e-3)
    assert chained - base == pytest.approx(on_path * 1e-3)
    assert on_path <= chain_moves
    relay = send_s("gpipe", stages, 4, 1e4, LINK, moves="boundary")
    assert send_s("gpipe", stages, 4, 1e4, LINK, moves="boundary", chain_s=1e-3) == relay


@hypothesis.given(schedule=st.sampled_from(["gpipe", "1f1b"]), stages=st.integers(2, 6),
                  micro=st.integers(1, 8))  # fmt: skip
def test_pipeline_send_time_lies_between_one_link_and_one_wire(schedule, stages, micro):
    """Without a bucket the sends take a whole number of sends' time: at most all 2 M (S - 1)
    one after another, at least boundary 0's 2 M one at a time with one permute per boundary,
    its M per direction with one move per tick (a 1F1B tick sends both ways over it at once);
    one move per tick never costs more than one per boundary, and under GPipe exactly its
    2 (M + S - 2) moves (every move starts when the one before it ends)."""
    one = LINK.latency + 1e4 / LINK.bandwidth
    k = send_s(schedule, stages, micro, 1e4, LINK) / one
    relay = send_s(schedule, stages, micro, 1e4, LINK, moves="boundary") / one
    for n in (k, relay):
        assert n == pytest.approx(round(n))
        assert round(n) <= 2 * micro * (stages - 1)
    assert micro <= round(k) <= round(relay) and 2 * micro <= round(relay)
    if schedule == "gpipe":
        assert round(k) == 2 * (micro + stages - 2)


def test_the_bucket_pays_for_a_send_on_an_idle_link_only():
    """S=2, M=2, a send of exactly the burst: the first forward and the first backward each
    find their buckets full (free); the second, right after, finds them empty."""
    link = _cost.NetworkLink(bandwidth=1e6, latency=0.0)
    assert send_s("gpipe", 2, 2, 5e3, link, 5e3) == pytest.approx(2 * 5e-3)
    assert send_s("gpipe", 2, 2, 5e3, link) == pytest.approx(4 * 5e-3)


@pytest.mark.parametrize("nbytes, burst", [(-1.0, 0.0), (float("nan"), 0.0), (1.0, -1.0),
                                           (1.0, float("inf"))])  # fmt: skip
def test_pipeline_send_time_refuses_bad_sizes(nbytes, burst):
    with pytest.raises(ValueError, match="must be finite"):
        send_s("gpipe", 4, 4, nbytes, LINK, burst)


def test_pipeline_send_time_refuses_a_bad_chain_delay():
    with pytest.raises(ValueError, match="chain_s must be finite"):
        send_s("gpipe", 4, 4, 1.0, LINK, chain_s=float("nan"))


def test_pipeline_send_time_refuses_an_unknown_program():
    with pytest.raises(ValueError, match="moves must be"):
        send_s("gpipe", 4, 4, 1.0, LINK, moves="wire")


def test_the_compute_between_moves_refills_the_bucket():
    """S=2, M=2 GPipe sends at ticks 0, 1 (forward) and 3, 4 (backward), each exactly the
    burst: played back to back the second of each pair finds its buckets empty (5 ms each);
    2.5 ms of compute per tick refills half (2.5 ms each); 5 ms refills all (free). The
    compute itself is not in the sends' time."""
    link = _cost.NetworkLink(bandwidth=1e6, latency=0.0)
    assert send_s("gpipe", 2, 2, 5e3, link, 5e3) == pytest.approx(2 * 5e-3)
    assert send_s("gpipe", 2, 2, 5e3, link, 5e3, tick_s=2.5e-3) == pytest.approx(2 * 2.5e-3)
    assert send_s("gpipe", 2, 2, 5e3, link, 5e3, tick_s=5e-3) == pytest.approx(0.0)
    assert send_s("gpipe", 2, 2, 5e3, link, tick_s=5e-3) == pytest.approx(4 * 5e-3)


@pytest.mark.parametrize("tick_s", [-1e-3, float("nan"), float("inf")])
def test_pipeline_send_time_refuses_a_bad_tick(tick_s):
    with pytest.raises(ValueError, match="tick_s must be finite"):
        send_s("gpipe", 4, 4, 1.0, LINK, tick_s=tick_s)


@pytest.mark.parametrize("compute_s", [[0.0], [0.0, -1.0], [0.0, float("nan")]])
def test_a_play_refuses_compute_that_does_not_fit_its_moves(compute_s):
    one = (_moves.Permute(((0, 1),), 1e4),)
    with pytest.raises(ValueError, match="compute_s needs one finite entry"):
        _pipeline_model.play_permutes([one, one], 2, LINK, compute_s=compute_s)
