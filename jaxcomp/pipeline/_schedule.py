r"""Pipeline schedules as tick tables: which stage runs which microbatch's forward or backward.

Time is cut into ticks; in each tick a stage runs at most one *op*: the forward ``F`` or the
backward ``B`` of one microbatch, or nothing (a bubble). A stage's forward of microbatch ``m``
sends its activation over boundary ``s`` at the end of the tick, and stage ``s + 1`` consumes it
in the very next tick; a backward sends the activation-gradient to stage ``s - 1`` the same
way. Both schedules take :math:`2(M + S - 1)` ticks and have the bubble fraction
:math:`(S - 1)/(M + S - 1)`:

================  ======================================  ==================================
schedule          forward of ``m`` on stage ``s``         backward of ``m`` on stage ``s``
================  ======================================  ==================================
``"gpipe"``       tick :math:`m + s`                      tick :math:`(M + S - 1) + m + (S - 1 - s)`
``"1f1b"``        tick :math:`2m + s`                     tick :math:`2m + 2S - 1 - s`
================  ======================================  ==================================

GPipe runs every forward, then every backward (a flush): all ``M`` microbatches' activations
are alive at once. 1F1B (PipeDream-flush) starts each microbatch's backward as soon as its
forward has reached the last stage; after a warm-up of at most ``S`` forwards every stage
alternates one forward and one backward (forwards on ticks of one parity, backwards on the
other), so stage ``s`` holds at most ``S - s`` microbatches' activations, whatever ``M`` is.
Both run the backwards of a boundary in microbatch order ``0 .. M - 1``, as they run its
forwards, so every link state sees the same sequence of updates under either schedule.

A schedule is one :class:`Timing` in :data:`TIMINGS` (the two formulas of the table above and
the period of its steady state); everything else is derived from its tick table: the segments,
the residual ring's slots (the most microbatches alive on a stage) and where each tick writes.

Runs of ticks whose pattern of ops repeats (period 1 for GPipe, 2 for 1F1B) become one
``lax.scan`` (:func:`segments`); the fill and drain ticks are unrolled with their active stages
known at trace time, so **bubble ticks send nothing and touch no state**, and the compiled
program holds exactly ``M`` sends per boundary and direction.

Not here: an interleaved (circular, "virtual stages") 1F1B, which would place several model
chunks on each device. Every table row is one device running one stage, and the residual
rings, link-state ends and sends are laid out per stage device; interleaving needs a chunk index
in each of them (and boundaries that wrap from the last device to the first), so it does not
fall out of this design.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class Timing(NamedTuple):
    """A schedule: the tick of each op, and the period of its steady state.

    Attributes:
      forward: ``forward(m, s, S, M)``, the tick of microbatch ``m``'s forward on stage ``s``.
      backward: ``backward(m, s, S, M)``, the tick of its backward (each boundary's backwards
        must run in microbatch order ``0 .. M - 1``, as its forwards do: the link states then
        see the same sequence of updates under every schedule).
      period: ticks after which the steady state's pattern of ops repeats (:func:`segments`
        scans such runs).
    """

    forward: Callable[[int, int, int, int], int]
    backward: Callable[[int, int, int, int], int]
    period: int


#: Every schedule, by name: adding one is adding its :class:`Timing` here (and a row to the
#: table of the module docstring); the tick engine, the residual ring and the checks follow.
TIMINGS = {
    "gpipe": Timing(
        forward=lambda m, s, S, M: m + s,
        backward=lambda m, s, S, M: (M + S - 1) + m + (S - 1 - s),
        period=1,
    ),
    "1f1b": Timing(
        forward=lambda m, s, S, M: 2 * m + s,
        backward=lambda m, s, S, M: 2 * m + 2 * S - 1 - s,
        period=2,
    ),
}
SCHEDULES = tuple(TIMINGS)


class Op(NamedTuple):
    """One stage's work in one tick: ``kind`` ``"F"`` or ``"B"`` on microbatch ``microbatch``."""

    kind: str
    microbatch: int


class Segment(NamedTuple):
    """Ticks ``start .. start + length - 1`` that share a pattern.

    ``pattern[j]`` is, per stage, the kind of op (``"F"``, ``"B"`` or ``None``) at the ticks
    ``start + j + i * period``; ``length`` is a multiple of ``period`` (``len(pattern)``).
    """

    start: int
    length: int
    pattern: tuple[tuple[str | None, ...], ...]

    @property
    def period(self) -> int:
        return len(self.pattern)

    @property
    def active(self) -> tuple[bool, ...]:
        """Per stage, whether it runs an op (forward-only tables have period 1)."""
        return tuple(k is not None for k in self.pattern[0])


def _check(schedule: str, num_stages: int, num_microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}.")
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}.")


@functools.lru_cache(maxsize=64)
def ticks(
    schedule: str, num_stages: int, num_microbatches: int, train: bool = True
) -> tuple[tuple[Op | None, ...], ...]:
    """The tick table: ``ticks(...)[t][s]`` is stage ``s``'s :class:`Op` at tick ``t`` (or None).

    Args:
      schedule: ``"gpipe"`` or ``"1f1b"``.
      num_stages: ``S``.
      num_microbatches: ``M``.
      train: ``False`` gives the forward-only table of evaluation (GPipe's forward ticks, for
        either schedule).

    Example:
      >>> [[op.kind + str(op.microbatch) if op else "." for op in row]
      ...  for row in ticks("1f1b", 2, 2)]
      [['F0', '.'], ['.', 'F0'], ['F1', 'B0'], ['B0', 'F1'], ['.', 'B1'], ['B1', '.']]
    """
    _check(schedule, num_stages, num_microbatches)
    s_, m_ = num_stages, num_microbatches
    timing = TIMINGS["gpipe" if not train else schedule]
    ops = [(m, s) for m in range(m_) for s in range(s_)]
    times = {(FORWARD, m, s): timing.forward(m, s, s_, m_) for m, s in ops}
    if train:
        times |= {(BACKWARD, m, s): timing.backward(m, s, s_, m_) for m, s in ops}
    table: list[list[Op | None]] = [[None] * s_ for _ in range(max(times.values()) + 1)]
    for (kind, m, s), t in times.items():
        assert table[t][s] is None, "two ops of one stage in one tick"
        table[t][s] = Op(kind, m)
    return tuple(tuple(row) for row in table)


def _kinds(row: tuple[Op | None, ...]) -> tuple[str | None, ...]:
    return tuple(op.kind if op else None for op in row)


@functools.lru_cache(maxsize=64)
def segments(
    schedule: str, num_stages: int, num_microbatches: int, train: bool = True
) -> tuple[Segment, ...]:
    """The tick table grouped into segments: repeating runs (scanned) and single ticks.

    Example:
      >>> [(s.start, s.length, s.period) for s in segments("gpipe", 3, 4, train=False)]
      [(0, 1, 1), (1, 1, 1), (2, 2, 1), (4, 1, 1), (5, 1, 1)]
    """
    table = ticks(schedule, num_stages, num_microbatches, train)
    kinds = [_kinds(row) for row in table]
    period = TIMINGS[schedule].period if train else 1
    out: list[Segment] = []
    t = 0
    while t < len(kinds):
        end = t + period
        while end < len(kinds) and kinds[end] == kinds[end - period]:
            end += 1
        repeats = (end - t) // period
        if period == 1 or repeats >= 2:
            length = repeats * period
            out.append(Segment(t, length, tuple(kinds[t : t + period])))
            t += length
        else:
            out.append(Segment(t, 1, (kinds[t],)))
            t += 1
    return tuple(out)


def gpipe_segments(num_stages: int, num_microbatches: int) -> tuple[Segment, ...]:
    """GPipe's ``M + S - 1`` forward ticks grouped into segments of identical active stages.

    Example:
      >>> [(s.start, s.length) for s in gpipe_segments(3, 4)]
      [(0, 1), (1, 1), (2, 2), (4, 1), (5, 1)]
    """
    return segments("gpipe", num_stages, num_microbatches, train=False)


def in_flight(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward has run and backward has not.

    Example:
      >>> in_flight("1f1b", 4, 32), in_flight("gpipe", 4, 32)
      ((4, 3, 2, 1), (32, 32, 32, 32))
    """
    table = ticks(schedule, num_stages, num_microbatches)
    alive, most = [0] * num_stages, [0] * num_stages
    for row in table:
        for s, op in enumerate(row):
            if op is not None and op.kind == FORWARD:
                alive[s] += 1
                most[s] = max(most[s], alive[s])
        for s, op in enumerate(row):
            if op is not None and op.kind == BACKWARD:
                alive[s] -= 1
    return tuple(most)


def residual_slots(schedule: str, num_stages: int, num_microbatches: int) -> int:
    """Slots of the per-stage residual ring buffer: microbatch ``m`` lives in slot
    ``m mod slots``, the most microbatches alive on a stage (:func:`in_flight`: ``S`` for
    1F1B, ``M`` for GPipe)."""
    return max(in_flight(schedule, num_stages, num_microbatches))


@functools.lru_cache(maxsize=64)
def write_slots(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, tuple]:
    """Where each stage writes a residual row at each training tick, so that every tick writes
    one row without reading the ring first: a forward writes its microbatch's slot, a backward
    rewrites the slot it has just consumed, an idle stage writes a slot nobody holds or, when
    every slot is alive (GPipe between its two phases), an extra scratch row.

    Returns:
      ``(rows, table)``: the ring's rows (``residual_slots``, or one more for the scratch row)
      and the ``[T][S]`` table of row indices.

    Example:
      >>> write_slots("1f1b", 4, 8)[0], write_slots("gpipe", 4, 8)[0]
      (4, 9)
    """
    slots = residual_slots(schedule, num_stages, num_microbatches)
    alive: list[set[int]] = [set() for _ in range(num_stages)]
    rows, out = slots, []
    for row in ticks(schedule, num_stages, num_microbatches):
        writes = []
        for s, op in enumerate(row):
            if op is None:
                free = sorted(set(range(slots)) - alive[s])
                rows = rows if free else slots + 1
                writes.append(free[0] if free else slots)
                continue
            slot = op.microbatch % slots
            if op.kind == FORWARD:
                assert slot not in alive[s], f"{schedule}: two live microbatches in slot {slot}"
                alive[s].add(slot)
            else:
                alive[s].discard(slot)
            writes.append(slot)
        out.append(tuple(writes))
    return rows, tuple(out)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction :math:`(S - 1) / (M + S - 1)` of each stage's ticks (both schedules)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
