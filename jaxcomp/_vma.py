"""Varying-axis types inside ``shard_map``: which mesh axes a value varies over, and the cast
that adds some. It imports only JAX, so every package (the codecs, the CPU door) may use it;
:mod:`jaxcomp.comm` exports both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes over which ``x`` varies, inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def to_varying(tree: Any, axes: str | Sequence[str]) -> Any:
    """Marks every leaf of ``tree`` as varying over ``axes`` (leaves already varying are kept)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)
