"""Bytes on the wire, read from compiled HLO.

The meter parses the text of a compiled XLA module (``jit(f).lower(...).compile().as_text()``),
finds every collective (``collective-permute``, ``all-reduce``, ``all-gather``, ``all-to-all``,
``reduce-scatter``, ``collective-broadcast``, and their async ``*-start`` forms), and counts the
bytes **one device contributes** per execution:

* ``collective-permute``, ``all-reduce``, ``all-to-all``, ``collective-broadcast``: the operand;
* ``all-gather``: the result divided by the group size;
* ``reduce-scatter``: the result times the group size.

Collectives inside ``while`` bodies (``lax.scan``, ``fori_loop``) are multiplied by the loop's
``known_trip_count``; nested loops multiply. A loop without a known trip count is counted once
and flagged in the report. Branches of a ``conditional`` are each counted once (an upper bound).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

KINDS = (
    "collective-permute",
    "all-reduce",
    "all-gather",
    "all-to-all",
    "reduce-scatter",
    "collective-broadcast",
    "ragged-all-to-all",
)
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128,
}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|f4e\w+|c64|c128)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\("
)
_CALLEE = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OP_NAME = re.compile(r'metadata=\{[^}]*?\bop_name="([^"]*)"')


class CollectiveRecord(NamedTuple):
    """One collective instruction of a compiled module."""

    name: str
    kind: str
    shape: str
    group_size: int
    bytes_per_execution: float
    executions: int
    computation: str
    #: a ``collective-permute``'s ``(source, target)`` pairs (each pair carries the operand);
    #: empty for other kinds
    pairs: tuple[tuple[int, int], ...] = ()
    #: the JAX operation it was lowered from (``metadata={op_name=...}``, e.g.
    #: ``"jit(f)/shard_map/ppermute"``; a collective XLA's partitioner made to reshard an array
    #: carries the resharded op's, e.g. ``"jit(f)/slice"``); empty without metadata
    op_name: str = ""

    @property
    def total_bytes(self) -> float:
        return self.bytes_per_execution * self.executions


class CollectiveReport(NamedTuple):
    """Collectives of a compiled module and their per-device bytes.

    Attributes:
      records: one :class:`CollectiveRecord` per collective instruction.
      unknown_trip_counts: names of ``while`` loops without a known trip count (their bodies are
        counted once).
    """

    records: tuple[CollectiveRecord, ...]
    unknown_trip_counts: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> float:
        """Per-device bytes over all collectives and executions."""
        return float(sum(r.total_bytes for r in self.records))

    def bytes_by_kind(self) -> dict[str, float]:
        """Per-device bytes summed per collective kind."""
        out: dict[str, float] = collections.defaultdict(float)
        for r in self.records:
            out[r.kind] += r.total_bytes
        return dict(out)

    def dtypes(self, kind: str | None = None) -> set[str]:
        """HLO element types (``"u8"``, ``"f32"``, ...) that travel, optionally for one kind."""
        return {
            dt
            for r in self.records
            if kind is None or r.kind == kind
            for dt, _ in _ARRAY.findall(r.shape)
        }

    def table(self) -> str:
        """A human-readable listing."""
        lines = [f"{'kind':20s} {'shape':40s} {'group':>5s} {'x':>5s} {'bytes':>12s}"]
        for r in self.records:
            shape = r.shape if len(r.shape) <= 40 else r.shape[:37] + "..."
            lines.append(
                f"{r.kind:20s} {shape:40s} {r.group_size:5d} {r.executions:5d} "
                f"{r.total_bytes:12.0f}"
            )
        lines.append(f"{'total':20s} {'':40s} {'':5s} {'':5s} {self.total_bytes:12.0f}")
        return "\n".join(lines)


def _array_bytes(text: str) -> float:
    total = 0.0
    for dt, dims in _ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        bits = _DTYPE_BITS.get(dt, 8 if dt.startswith("f8") else 4 if dt.startswith("f4") else 32)
        total += n * bits / 8
    return total


def _tuple_elements(text: str) -> list[str]:
    """Top-level elements of an HLO tuple type ``(a, (b, c), d)``; ``[text]`` if not a tuple."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            out.append(text[start:i])
            start = i + 1
    return [e.strip() for e in out if e.strip()]


def _permute_pairs(line: str) -> tuple[tuple[int, int], ...]:
    m = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line)
    found = re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if m else ()
    return tuple((int(a), int(b)) for a, b in found)


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return num_devices


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The instruction lines of every computation in HLO text, by name, and the entry's name
    (the ``ENTRY`` computation, else the last one; ``None`` for text with no computation)."""
    comps: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
        elif current is not None:
            comps[current].append(line)
    if entry is None and comps:
        entry = next(reversed(comps))
    return comps, entry


def collective_report(hlo_text: str) -> CollectiveReport:
    """Parses compiled HLO text into a :class:`CollectiveReport`.

    Args:
      hlo_text: ``compiled.as_text()`` of a jitted function.

    Returns:
      The collectives found, with per-device bytes and execution counts.
    """
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(m.group(1)) if m else 1
    comps, entry = computations(hlo_text)

    edges: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    unknown = []
    for comp, lines in comps.items():
        for line in lines:
            callees = _CALLEE.findall(line)
            if not callees:
                continue
            trip = 1
            if " while(" in line:
                t = _TRIP.search(line)
                if t:
                    trip = int(t.group(1))
                else:
                    unknown.append(line.split("=")[0].strip())
            for attr, target in callees:
                for name in re.findall(r"%?([\w.\-]+)", target):
                    edges[comp].append((name, trip if attr == "body" else 1))

    multiplier: dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        multiplier[comp] += times
        for callee, trip in edges.get(comp, ()):
            visit(callee, times * trip, depth + 1)

    if entry is not None:
        visit(entry, 1)

    records = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape, kind, is_start = m.groups()
            if is_start:
                shape = _tuple_elements(shape)[0]  # async start: (operands, results, ...)
            nbytes = _array_bytes(shape)
            group = _group_size(line, num_devices)
            if kind == "all-gather" and not is_start:
                nbytes /= group
            elif kind == "reduce-scatter" and not is_start:
                nbytes *= group
            pairs = _permute_pairs(line) if kind == "collective-permute" else ()
            op = _OP_NAME.search(line)
            op_name = op.group(1) if op else ""
            records.append(
                CollectiveRecord(
                    name, kind, shape.strip(), group, nbytes, multiplier[comp], comp, pairs, op_name
                )
            )
    return CollectiveReport(tuple(records), tuple(unknown))


def measure_collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveReport:
    """Compiles ``fn`` for ``args`` (without running it) and reports its collectives.

    Args:
      fn: a function (jitted or not); keyword arguments are passed through to it as static
        closure values.
      *args: example arguments (arrays or ``ShapeDtypeStruct`` values with shardings).

    Returns:
      A :class:`CollectiveReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import comm
      >>> comm.measure_collectives(lambda x: x * 2, jnp.ones(4)).total_bytes
      0.0
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    if kwargs:
        jitted = jax.jit(lambda *a: fn(*a, **kwargs))
    return collective_report(jitted.lower(*args).compile().as_text())
