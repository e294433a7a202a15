"""The tick tables of the GPipe and 1F1B schedules."""

import itertools

import pytest

from jaxcomp import pipeline
from jaxcomp.pipeline import _schedule

SIZES = [(2, 2), (4, 4), (4, 8), (3, 7), (4, 32)]


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_segments_cover_every_tick_and_each_stage_works_m_ticks(stages, microbatches):
    segments = pipeline.gpipe_segments(stages, microbatches)
    ticks = [t for seg in segments for t in range(seg.start, seg.start + seg.length)]
    assert ticks == list(range(microbatches + stages - 1))
    for s in range(stages):
        active = [t for seg in segments if seg.active[s]
                  for t in range(seg.start, seg.start + seg.length)]  # fmt: skip
        assert active == list(range(s, s + microbatches))  # microbatch t - s at tick t
    # fill and drain are unrolled one tick at a time; the steady phase is one scan
    assert len(segments) == 2 * (stages - 1) + 1
    assert segments[stages - 1].length == microbatches - stages + 1


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_every_op_once_in_dependency_order(schedule, stages, microbatches):
    table = pipeline.ticks(schedule, stages, microbatches)
    when = {}
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                assert (op.kind, op.microbatch, s) not in when
                when[(op.kind, op.microbatch, s)] = t
    assert len(when) == 2 * stages * microbatches
    assert len(table) == 2 * (microbatches + stages - 1)
    for m, s in itertools.product(range(microbatches), range(stages)):
        if s > 0:  # the activation arrives the tick after the stage before sent it
            assert when[("F", m, s)] == when[("F", m, s - 1)] + 1
        if s < stages - 1:
            assert when[("B", m, s)] == when[("B", m, s + 1)] + 1
        else:
            assert when[("B", m, s)] > when[("F", m, s)]
        # every boundary's microbatches go in order 0 .. M - 1, both ways
        if m > 0:
            assert when[("F", m, s)] > when[("F", m - 1, s)]
            assert when[("B", m, s)] > when[("B", m - 1, s)]
    if schedule == "gpipe":  # a flush: every forward before any backward
        last_forward = max(t for (k, _, _), t in when.items() if k == "F")
        assert all(t > last_forward for (k, _, _), t in when.items() if k == "B")


@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_1f1b_keeps_at_most_s_minus_stage_microbatches_alive(stages, microbatches):
    assert pipeline.in_flight("1f1b", stages, microbatches) == tuple(
        min(stages - s, microbatches) for s in range(stages)
    )
    assert pipeline.in_flight("gpipe", stages, microbatches) == (microbatches,) * stages
    # after a warm-up of at most S forwards, each stage alternates one forward, one backward
    for s in range(stages):
        ops = [row[s].kind for row in pipeline.ticks("1f1b", stages, microbatches) if row[s]]
        warm = ops.index("B")
        assert warm <= stages
        steady = ops[warm - 1 : warm - 1 + 2 * (microbatches - warm + 1)]
        assert steady == ["F", "B"] * (microbatches - warm + 1)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_residual_slots_are_never_overwritten_while_alive(schedule):
    stages, microbatches = 4, 9
    slots = _schedule.residual_slots(schedule, stages, microbatches)
    for s in range(stages):
        held = {}
        for row in pipeline.ticks(schedule, stages, microbatches):
            op = row[s]
            if op is None:
                continue
            slot = op.microbatch % slots
            if op.kind == "F":
                assert slot not in held
                held[slot] = op.microbatch
            else:
                assert held.pop(slot) == op.microbatch


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_segments_repeat_their_pattern(schedule):
    table = pipeline.ticks(schedule, 4, 12)
    segs = _schedule.segments(schedule, 4, 12)
    assert sum(s.length for s in segs) == len(table)
    scanned = [s for s in segs if s.length > s.period]
    assert scanned, "the steady phase is a scan"
    for seg in segs:
        for i in range(seg.length):
            kinds = tuple(op.kind if op else None for op in table[seg.start + i])
            assert kinds == seg.pattern[i % seg.period]


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.ticks("interleaved", 4, 8)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        pipeline.ticks("1f1b", 4, 0)
