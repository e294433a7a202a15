"""Checking that every branch holding a collective is taken by the whole collective group.

A ``lax.cond``/``lax.switch`` (or a ``lax.while_loop``) whose branch runs a collective over mesh
axis ``a`` must be decided identically by every device along ``a``: a device that skips the
collective leaves the others waiting (on CPU, XLA aborts after 40 s; on NCCL or TPU it hangs).
``shard_map``'s varying-manual-axes typing already knows which values may differ along which
axes (``jax.typeof(x).vma``), so the rule can be checked on a traced program, without running it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
from jax.extend import core

from jaxcomp import _jax_private

#: Primitives that communicate over the mesh axes named in their parameters.
COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pshuffle",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "psum_scatter",
        "pgather",
    }
)
_AXIS_PARAMS = ("axes", "axis_name")


class NonUniformCollectiveError(ValueError):
    """A branch or loop holding a collective may be taken by only part of the collective's group."""


@dataclasses.dataclass(frozen=True)
class Violation:
    """One branching equation whose decision may differ inside a collective's group.

    Attributes:
      primitive: ``"cond"`` (also ``lax.switch``) or ``"while"``.
      where: the equation's source location (``file:line (function)``) where JAX recorded it.
      axes: the mesh axes of the collectives inside whose groups the decision may differ.
      collectives: ``"primitive over axes"`` of each collective inside the branches or body.
      reason: ``"varying"`` (the predicate's type varies over ``axes``) or ``"unchecked"``
        (inside a ``shard_map`` with ``check_vma=False``: the typing that proves uniformity is
        off, so nothing can be proven).
    """

    primitive: str
    where: str
    axes: tuple[str, ...]
    collectives: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        what = {
            "varying": f"its predicate varies over {', '.join(self.axes)}",
            "unchecked": "it is inside a shard_map with check_vma=False (uniformity unknown)",
        }[self.reason]
        return (
            f"{self.primitive} at {self.where}: {what}, but it holds {'; '.join(self.collectives)}"
        )


@dataclasses.dataclass(frozen=True)
class UniformityReport:
    """What :func:`collective_uniformity` found.

    Attributes:
      branches: branching equations (``cond``/``switch``/``while``) inside ``shard_map``
        bodies that hold at least one collective; each was checked.
      collectives: collectives found anywhere in the program.
      violations: the equations breaking the rule (empty when the program is uniform).
    """

    branches: int
    collectives: int
    violations: tuple[Violation, ...]


def _axes_of(eqn: core.JaxprEqn) -> tuple[str, ...]:
    names: list[Any] = []
    for key in _AXIS_PARAMS:
        value = eqn.params.get(key)
        if value is None:
            continue
        names.extend(value if isinstance(value, (tuple, list)) else [value])
    return tuple(n for n in names if isinstance(n, str))  # ints are positional (vmap) axes


def _sub_jaxprs(eqn: core.JaxprEqn) -> Iterator[core.Jaxpr]:
    """Every jaxpr held in the equation's parameters (pjit, shard_map, scan, while, cond,
    custom_vjp/custom_jvp calls, remat, ...)."""
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _collectives(jaxpr: core.Jaxpr) -> Iterator[tuple[str, tuple[str, ...]]]:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
            yield eqn.primitive.name, _axes_of(eqn)
        for sub in _sub_jaxprs(eqn):
            yield from _collectives(sub)


def _vma(atom: Any) -> frozenset[str]:
    """The mesh axes ``atom``'s value may vary over (its type's varying manual axes)."""
    if isinstance(atom, core.Literal):
        return frozenset()
    aval = atom.aval
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10: ManualAxisType(varying=...)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())  # older spelling


def _where(eqn: core.JaxprEqn) -> str:
    try:
        return _jax_private.summarize_source(eqn.source_info)
    except Exception:  # noqa: BLE001 - a location is a courtesy; never fail the check on it
        return "<unknown location>"


class _Walker:
    def __init__(self) -> None:
        self.branches = 0
        self.collectives = 0
        self.violations: list[Violation] = []

    def walk(self, jaxpr: core.Jaxpr, manual: bool, checked: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in COLLECTIVES:
                self.collectives += 1
            if manual and name in ("cond", "while"):
                self._check(eqn, checked)
            if name == "shard_map":
                inner_checked = bool(eqn.params.get("check_vma", True))
                for sub in _sub_jaxprs(eqn):
                    self.walk(sub, True, inner_checked)
            else:
                for sub in _sub_jaxprs(eqn):
                    self.walk(sub, manual, checked)

    def _check(self, eqn: core.JaxprEqn, checked: bool) -> None:
        if eqn.primitive.name == "cond":
            inner = [b.jaxpr for b in eqn.params["branches"]]
            predicate = _vma(eqn.invars[0])
        else:  # while: the predicate is the cond_jaxpr's output
            cond_jaxpr = eqn.params["cond_jaxpr"].jaxpr
            inner = [cond_jaxpr, eqn.params["body_jaxpr"].jaxpr]
            predicate = _vma(cond_jaxpr.outvars[0])
        found = [c for j in inner for c in _collectives(j)]
        if not found:
            return
        self.branches += 1
        axes = sorted({a for _, names in found for a in names})
        described = tuple(sorted({f"{p} over {', '.join(names) or '?'}" for p, names in found}))
        if not checked:
            bad, reason = tuple(axes), "unchecked"
        else:
            bad, reason = tuple(a for a in axes if a in predicate), "varying"
        if bad:
            self.violations.append(
                Violation(eqn.primitive.name, _where(eqn), bad, described, reason)
            )


def collective_uniformity(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> UniformityReport:
    r"""Traces ``fn(*args, **kwargs)`` and reports branches that may split a collective's group.

    For every ``cond``/``switch``/``while`` inside a ``shard_map`` body whose branches (or loop
    condition and body) hold a collective over mesh axis :math:`a`, the predicate (switch
    index, loop condition) must be uniform over :math:`a`:
    :math:`a \notin \mathrm{vma}(\\text{predicate})`. Sub-programs are searched through
    ``jit``, ``shard_map``, ``scan``, ``while``, ``cond``, ``custom_vjp``/``custom_jvp`` and
    ``remat``; gradients count when ``fn`` takes them (the transposed program is traced).

    Args:
      fn: the step, as it is called (jitted or not), or a traced program
        (``jax.jit(f).trace(*args)``, a ``ClosedJaxpr``; then without ``args``).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (with shardings where ``fn``
        needs them); nothing runs.
      **kwargs: its keyword arguments.

    Returns:
      A :class:`UniformityReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import comm
      >>> comm.collective_uniformity(jnp.sin, jnp.ones(3)).violations
      ()
    """
    if isinstance(fn, jax.stages.Traced):
        closed = fn.jaxpr
    elif isinstance(fn, core.ClosedJaxpr):
        closed = fn
    else:
        closed = jax.make_jaxpr(fn)(*args, **kwargs)
    walker = _Walker()
    walker.walk(closed.jaxpr, manual=False, checked=True)
    return UniformityReport(walker.branches, walker.collectives, tuple(walker.violations))


def check_collective_uniformity(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> UniformityReport:
    """Like :func:`collective_uniformity`, but raises on a violation.

    Raises:
      NonUniformCollectiveError: (a ``ValueError``) listing every offending equation with its
        source location, the axes and the collectives.

    Example:
      >>> # report = comm.check_collective_uniformity(step, params, batch)
      >>> # report.branches: how many branches holding collectives were proven uniform
    """
    report = collective_uniformity(fn, *args, **kwargs)
    if report.violations:
        lines = "\n  ".join(str(v) for v in report.violations)
        raise NonUniformCollectiveError(
            f"{len(report.violations)} branch(es) may be taken by only part of a collective's "
            f"group (a hang on GPU/TPU, an abort on CPU); make the predicate uniform over the "
            f"axis (e.g. decide it from a psum/pmax or from replicated inputs):\n  {lines}"
        )
    return report
