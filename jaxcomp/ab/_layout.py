"""Which parameters AB-Training factorises, and their tall 2-D views.

A parameter is *factorised* when it has at least two non-trivial dimensions (the reference's
``weight.squeeze().ndim > 1``) and no excluded name matches its path. Everything else (biases,
norm scales, excluded layers such as the first convolution and the classifier) stays dense.

The 2-D view of a Flax kernel ``(..., out)`` is ``(prod(shape[:-1]), out)`` (for ``Dense``
``(in, out)``, for ``Conv`` ``(kh, kw, in, out)``); it is transposed when it is wide, so the
working matrix is always *tall*, ``(m, n)`` with ``m >= n``. PyTorch's ``weight.view(out, -1)``
used by the reference is the same matrix up to a transpose and a permutation of columns, so the
singular values, ranks and factor sizes agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax


class FactorSpec(NamedTuple):
    """Static description of one factorised parameter.

    Attributes:
      path: the parameter's path, ``"/"``-joined (``"params/Conv_1/kernel"``).
      shape: the parameter's shape.
      rows: ``m``, rows of the tall 2-D view.
      cols: ``n``, columns of the tall 2-D view (``m >= n``); the full rank.
      transposed: whether the tall view is the transpose of ``reshape(-1, shape[-1])``.
    """

    path: str
    shape: tuple[int, ...]
    rows: int
    cols: int
    transposed: bool


class ABLayout(NamedTuple):
    """How a parameter tree splits into factorised and dense leaves (all static).

    Attributes:
      treedef: the parameter tree's structure.
      factored: flat leaf indices of the factorised parameters.
      dense: flat leaf indices of the parameters that stay dense.
      specs: one :class:`FactorSpec` per factorised parameter, in ``factored`` order.
      paths: paths of all leaves, in flat order.
    """

    treedef: Any
    factored: tuple[int, ...]
    dense: tuple[int, ...]
    specs: tuple[FactorSpec, ...]
    paths: tuple[str, ...]

    def split(self, tree: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``tree`` -> (factorised leaves, dense leaves), as tuples in layout order."""
        leaves = self.treedef.flatten_up_to(tree)
        return tuple(leaves[i] for i in self.factored), tuple(leaves[i] for i in self.dense)

    def merge(self, factored: Sequence[Any], dense: Sequence[Any]) -> Any:
        """Inverse of :meth:`split`."""
        leaves: list[Any] = [None] * (len(self.factored) + len(self.dense))
        for i, x in zip(self.factored, factored):
            leaves[i] = x
        for i, x in zip(self.dense, dense):
            leaves[i] = x
        return self.treedef.unflatten(leaves)


def path_string(keypath: Sequence[Any]) -> str:
    """``"/"``-joined names of a ``jax.tree_util`` key path."""
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _components(name: str) -> list[str]:
    return [c for c in re.split(r"[/.]", name) if c]


def name_matches(name: str, path: str) -> bool:
    """Whether ``name`` (``"Conv_0"``, ``"features.0"``, ``"Dense_1/kernel"``) names ``path``.

    The name's components (split at ``/`` or ``.``) must appear as a contiguous run of the
    path's components.
    """
    want, have = _components(name), _components(path)
    if not want:
        return False
    return any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def matrix_dims(shape: Sequence[int]) -> tuple[int, int, bool]:
    """``(m, n, transposed)`` of the tall 2-D view of a kernel of ``shape``."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return max(rows, cols), min(rows, cols), rows < cols


def is_factorisable(shape: Sequence[int]) -> bool:
    """At least two dimensions larger than one (``squeeze().ndim > 1``)."""
    return sum(d > 1 for d in shape) >= 2


def build_layout(params: Any, exclude: Sequence[str] = ()) -> ABLayout:
    """Classifies the leaves of ``params``.

    Args:
      params: the dense parameter tree (arrays or ``ShapeDtypeStruct``s).
      exclude: names of layers that stay full-rank (see :func:`name_matches`).

    Returns:
      The :class:`ABLayout`.

    Raises:
      ValueError: if a name in ``exclude`` matches no parameter; the message lists the layer
        paths that exist.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_string(kp) for kp, _ in with_path)
    unmatched = [n for n in exclude if not any(name_matches(n, p) for p in paths)]
    if unmatched:
        layers = sorted({p.rsplit("/", 1)[0] for p in paths})
        raise ValueError(
            f"exclude: {unmatched} match no parameter. Parameter paths look like "
            f"{list(paths[:3])}; layers are {layers}."
        )
    factored, dense, specs = [], [], []
    for i, ((_, leaf), path) in enumerate(zip(with_path, paths)):
        shape = tuple(leaf.shape)
        excluded = any(name_matches(n, path) for n in exclude)
        if is_factorisable(shape) and not excluded:
            m, n, transposed = matrix_dims(shape)
            factored.append(i)
            specs.append(FactorSpec(path, shape, m, n, transposed))
        else:
            dense.append(i)
    return ABLayout(treedef, tuple(factored), tuple(dense), tuple(specs), paths)
