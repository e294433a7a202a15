"""The collectives of a training step, per kind and group, as a run's summary records them.

A mode's summary holds ``collectives``: the collectives one device runs in a mean training step
of the run, one record per (kind, group size, bytes per execution, whether it sits in a
branch)::

  {"kind": "all-reduce", "group_size": 8, "bytes_per_execution": 1024.0,
   "executions": 2.0, "conditional": False}

``executions`` is the mean number of times per step: a float when programs differ between
steps (AB-Training's step kinds, weighted by how often the schedule runs each). The study
report prices these with the cost model (:mod:`jaxcomp.study._cost`) and sums them per kind.

Collectives inside a ``conditional`` (``lax.cond``/``lax.switch``: Accordion's per-layer
modes, an update that runs only every k micro-batches) run in some steps only; the compiled HLO
holds every branch, so their records are marked ``conditional`` and count every branch once.
The report scales them to the run's measured mean bytes per step (the transform counts what it
sends each step); records outside any branch run every step and are exact.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable
from typing import Any

from jaxcomp import comm
from jaxcomp.comm import _hlo
from jaxcomp.train import _metrics

_BRANCHES = re.compile(
    r"\b(?:branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)


def conditional_computations(hlo_text: str) -> set[str]:
    """Names of the computations that run only when a ``conditional`` picks them (directly or
    called from a branch), in compiled HLO text."""
    comps, _ = _hlo.computations(hlo_text)
    callees = collections.defaultdict(set)
    roots: set[str] = set()
    for comp, lines in comps.items():
        for line in lines:
            for _, target in _hlo._CALLEE.findall(line):
                callees[comp].update(re.findall(r"%?([\w.\-]+)", target))
            for target in _BRANCHES.findall(line):
                roots.update(re.findall(r"%?([\w.\-]+)", target))
    seen, todo = set(), list(roots)
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo.extend(callees.get(comp, ()))
    return seen


def records(hlo_text: str, weight: float = 1.0) -> list[dict[str, Any]]:
    """The collectives of one compiled program, run ``weight`` times per mean step.

    Args:
      hlo_text: ``compiled.as_text()``.
      weight: how many times per step the program runs on average (1 for a program every step
        runs; ``n_k / N`` for a step kind run ``n_k`` of ``N`` steps).

    Returns:
      Summary records (see the module docstring), identical ones merged.

    Example:
      >>> # records(jax.jit(step).lower(state, batch).compile().as_text())
    """
    report = comm.collective_report(hlo_text)
    branched = conditional_computations(hlo_text) if report.records else set()
    return merge(
        {
            "kind": r.kind,
            "group_size": int(r.group_size),
            "bytes_per_execution": float(r.bytes_per_execution),
            "executions": float(r.executions) * weight,
            "conditional": r.computation in branched,
        }
        for r in report.records
    )


def from_report(report: comm.CollectiveReport, weight: float = 1.0) -> list[dict[str, Any]]:
    """Summary records of a :class:`~jaxcomp.comm.CollectiveReport` whose collectives all run
    (e.g. one role's part of an AB program), ``weight`` times per mean step."""
    return merge(
        {
            "kind": r.kind,
            "group_size": int(r.group_size),
            "bytes_per_execution": float(r.bytes_per_execution),
            "executions": float(r.executions) * weight,
            "conditional": False,
        }
        for r in report.records
    )


def merge(*parts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (kind, group size, bytes per execution, conditional), executions summed;
    records with no execution are dropped."""
    out: dict[tuple, float] = collections.defaultdict(float)
    for part in parts:
        for r in part:
            key = (r["kind"], r["group_size"], r["bytes_per_execution"], r["conditional"])
            out[key] += r["executions"]
    return [
        {"kind": k, "group_size": g, "bytes_per_execution": b, "executions": n, "conditional": c}
        for (k, g, b, c), n in sorted(out.items())
        if n > 0
    ]


def describe(recs: Iterable[dict[str, Any]]) -> str:
    """One line: bytes per mean step per ``kind/devices`` (``"*"``: some in branches, an upper
    bound that counts every branch)."""
    out: dict[str, float] = collections.defaultdict(float)
    branched = set()
    for r in recs:
        key = f"{r['kind']}/{r['group_size']}"
        out[key] += r["bytes_per_execution"] * r["executions"]
        if r["conditional"]:
            branched.add(key)
    parts = [f"{k}{'*' * (k in branched)} {_metrics.format_bytes(v)}" for k, v in out.items()]
    return ", ".join(parts) or "none"
