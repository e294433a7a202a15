r"""A pipeline step's boundary permutes as the tick program compiles them, for the cost model.

Per tick (:func:`jaxcomp.pipeline.ticks`) the boundaries whose sender worked send: the forwards
(stage :math:`b` to :math:`b + 1`) and the backwards (:math:`b + 1` to :math:`b`) in one *move*
where no stage receives twice (1F1B), else one move per direction, as the engine groups them
(:func:`jaxcomp.pipeline._ticks.tick_moves`, imported). A move whose payloads are
:math:`n_1 < \dots < n_k` distinct sizes
is :math:`k` ``collective-permute``\ s, cut as the engine cuts them
(:func:`jaxcomp.pipeline._ticks.move_pieces`, imported, not re-derived): permute :math:`j`
carries bytes :math:`[n_{j-1}, n_j)` of every payload of at least :math:`n_j` bytes, one pair
per such send. Payloads alike are one permute per move. So a step sends every payload
once, :math:`M \sum_b (|f_b| + |g_b|)` bytes, in as many permutes as its moves have distinct
sizes; :func:`jaxcomp.study._pipeline_model.pipeline_send_s` plays them in this order on
per-host links (an :math:`\alpha` per permute and pair, a :math:`\beta` per byte, the chain
delay where a receiver also sends in the same permute).
"""

from __future__ import annotations

import collections
import math
import numbers
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

from jaxcomp import pipeline
from jaxcomp.pipeline._ticks import move_pieces
from jaxcomp.pipeline._ticks import tick_moves


class Permute(NamedTuple):
    """One ``collective-permute`` of a pipeline step.

    Attributes:
      pairs: its ``(source stage, target stage)`` pairs, in the move's boundary order.
      nbytes: the bytes each pair carries.
    """

    pairs: tuple[tuple[int, int], ...]
    nbytes: float


def _check_payloads(payload_bytes, stages: int) -> list[tuple[float, float]]:
    sizes = [tuple(p) for p in payload_bytes]
    if len(sizes) != stages - 1 or any(len(p) != 2 for p in sizes):
        raise ValueError(
            f"payload_bytes needs one (forward, backward) pair per boundary ({stages - 1} for "
            f"{stages} stages); got {list(payload_bytes)!r}."
        )
    for b, pair in enumerate(sizes):
        for n in pair:
            if not (isinstance(n, numbers.Real) and n >= 0 and math.isfinite(n)):
                raise ValueError(f"payload_bytes[{b}] must be finite and >= 0; got {pair}.")
    return sizes


def pipeline_moves(
    schedule: str,
    stages: int,
    microbatches: int,
    payload_bytes: Sequence[Sequence[float]],
    train: bool = True,
) -> list[tuple[Permute, ...]]:
    """The permutes of one pipeline step, move by move (module docstring).

    Args:
      schedule, stages, microbatches: the pipeline (``"gpipe"`` or ``"1f1b"``, ``S``, ``M``).
      payload_bytes: per boundary, the bytes of one microbatch's ``(forward, backward)``
        payload (``jaxcomp.pipeline._links.link_bytes``; :func:`boundary_payloads` reads them
        back from a compiled step).
      train: ``False``: evaluation's forward ticks.

    Returns:
      One tuple of :class:`Permute` per move (:func:`jaxcomp.pipeline._ticks.tick_moves`), in
      program order.

    Example:
      >>> [[(p.pairs, p.nbytes) for p in m]
      ...  for m in pipeline_moves("gpipe", 3, 1, [(8, 0), (24, 0)], train=False)]
      [[(((0, 1),), 8)], [(((1, 2),), 24)]]
      >>> [[(p.pairs, p.nbytes) for p in m]
      ...  for m in pipeline_moves("gpipe", 3, 2, [(8, 0), (24, 0)], train=False)][1]
      [(((0, 1), (1, 2)), 8), (((1, 2),), 16)]
    """
    sizes = _check_payloads(payload_bytes, stages)
    out = []
    for _, pairs in _moves(schedule, stages, microbatches, train):
        pieces = move_pieces([sizes[min(s, d)][int(s > d)] for s, d in pairs])
        out.append(tuple(Permute(tuple(pairs[i] for i in members), high - low)
                         for low, high, members in pieces))  # fmt: skip
    return out


def move_ticks(schedule: str, stages: int, microbatches: int, train: bool = True) -> list[int]:
    """The tick of each move of :func:`pipeline_moves`, in its order (the compute a host does
    before a move is its ticks' since the move before).

    Example:
      >>> move_ticks("gpipe", 2, 2)  # forwards at ticks 0, 1; backwards at 3, 4
      [0, 1, 3, 4]
    """
    return [t for t, _ in _moves(schedule, stages, microbatches, train)]


def _moves(schedule: str, stages: int, microbatches: int, train: bool):
    """``(tick, pairs)`` per move: its ``(source, target)`` stage pairs."""
    for t, row in enumerate(pipeline.ticks(schedule, stages, microbatches, train)):
        for pairs in tick_moves([None if op is None else op.kind for op in row]):
            yield t, pairs


def boundary_payloads(
    permutes: Iterable[Mapping], stages: int, microbatches: int
) -> list[tuple[float, float]] | None:
    """Each boundary's payload per microbatch, ``(forward, backward)`` bytes, read from a
    step's compiled permutes (records with ``pairs``, ``bytes_per_execution`` and
    ``executions``, as ``jaxcomp.comm.collective_report`` has them): every boundary sends each
    microbatch's payload once per direction, in pieces, so a pair's bytes over the step are
    ``M`` payloads. ``None`` where a pair is not two neighbouring stages ``0 .. S - 1`` (a mesh
    with a data axis numbers its devices past the stages).

    Example:
      >>> rec = {"pairs": [[0, 1], [1, 2]], "bytes_per_execution": 8.0, "executions": 2}
      >>> boundary_payloads([rec], 3, 2)
      [(8, 0), (8, 0)]
    """
    sent: dict[tuple[int, int], float] = collections.defaultdict(float)
    for r in permutes:
        for s, d in r["pairs"]:
            if not (0 <= min(s, d) and max(s, d) < stages and abs(s - d) == 1):
                return None
            sent[int(s), int(d)] += float(r["bytes_per_execution"]) * float(r["executions"])

    def per_send(pair):
        n = sent[pair] / microbatches
        return int(n) if n == int(n) else n

    return [(per_send((b, b + 1)), per_send((b + 1, b))) for b in range(stages - 1)]


def same_permutes(permutes: Iterable[Mapping], moves: Iterable[tuple[Permute, ...]]) -> bool:
    """Whether a step's compiled permutes (records as :func:`boundary_payloads` takes them)
    are the played ``moves``' permutes, pairs and bytes, as many times each."""
    compiled = collections.Counter()
    for r in permutes:
        key = (float(r["bytes_per_execution"]), tuple(sorted(tuple(p) for p in r["pairs"])))
        compiled[key] += float(r["executions"])
    played = collections.Counter()
    for move in moves:
        for p in move:
            played[float(p.nbytes), tuple(sorted(p.pairs))] += 1.0
    return +compiled == +played
