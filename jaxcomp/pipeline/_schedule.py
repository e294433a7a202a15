"""The GPipe tick schedule, split into segments with a static set of active stages.

With ``S`` stages and ``M`` microbatches, GPipe runs ``T = M + S - 1`` forward ticks; at tick
``t`` stage ``s`` works on microbatch ``t - s`` when ``0 <= t - s < M`` and idles otherwise (the
bubble), and boundary ``b`` sends exactly when stage ``b`` is active. The backward pass is the
reverse. Ticks ``S - 1 .. M - 1`` (all stages active) form one steady segment, run as a
``lax.scan``; the ``S - 1`` fill and ``S - 1`` drain ticks are unrolled with their active set
known at trace time. Hence **bubble ticks send nothing and touch no state**, and the compiled
program contains exactly ``M`` sends per boundary and direction, which the HLO meter can check.
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """Consecutive ticks ``start .. start + length - 1`` with the same active stages."""

    start: int
    length: int
    active: tuple[bool, ...]  # per stage


def gpipe_segments(num_stages: int, num_microbatches: int) -> tuple[Segment, ...]:
    """The GPipe forward ticks grouped into segments of identical active sets.

    Example:
      >>> [(s.start, s.length) for s in gpipe_segments(3, 4)]
      [(0, 1), (1, 1), (2, 2), (4, 1), (5, 1)]
    """
    s_, m_ = num_stages, num_microbatches
    segments: list[Segment] = []
    for t in range(m_ + s_ - 1):
        active = tuple(0 <= t - s < m_ for s in range(s_))
        if segments and segments[-1].active == active:
            last = segments[-1]
            segments[-1] = last._replace(length=last.length + 1)
        else:
            segments.append(Segment(t, 1, active))
    return tuple(segments)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle fraction :math:`(S - 1) / (M + S - 1)` of each stage's ticks."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
