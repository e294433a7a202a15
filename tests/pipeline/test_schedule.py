"""The GPipe tick schedule."""

import pytest

from jaxcomp import pipeline


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


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
