r"""Factorisation W = A·B by SVD, factor gradients, and rank-capacity surgery.

For a tall 2-D view :math:`W \in \mathbb{R}^{m \times n}` (:mod:`._layout`) with SVD
:math:`W = U \Sigma V^\top`, AB-Training keeps

.. math::
  A = U_{:, :r} \Sigma_{:r}^{1/2}, \qquad B = \Sigma_{:r}^{1/2} V_{:, :r}^\top
  \qquad (\texttt{split\_sigma=True})

or, with ``split_sigma=False``, :math:`\Sigma` on the factor the worker trains
(:math:`A = U\Sigma, B = V^\top` for A-trainers, :math:`A = U, B = \Sigma V^\top` for B-trainers).

Factors are stored at a static *capacity* ``c >= r`` (``A: [m, c]``, ``B: [c, n]``) with the
columns of ``A`` and rows of ``B`` beyond the rank ``r`` held at zero, so the rank can change
under ``jit``; :func:`resize_rank_axis` changes the capacity itself (between compiled steps).

The gradients of the factors follow from the dense gradient :math:`G = \partial L/\partial W`:

.. math::
  \frac{\partial L}{\partial A} = G B^\top, \qquad \frac{\partial L}{\partial B} = A^\top G.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh

from jaxcomp import _cpu
from jaxcomp._cpu import _layouts
from jaxcomp.ab._layout import FactorSpec
from jaxcomp.comm import to_varying
from jaxcomp.comm import varying_axes


def to_matrix(x: jax.Array, spec: FactorSpec) -> jax.Array:
    """The tall ``[m, n]`` view of a parameter (or of its gradient)."""
    w = x.reshape(-1, spec.shape[-1])
    return w.T if spec.transposed else w


def from_matrix(w: jax.Array, spec: FactorSpec) -> jax.Array:
    """Inverse of :func:`to_matrix`."""
    return (w.T if spec.transposed else w).reshape(spec.shape)


def rank_mask(rank: jax.Array, capacity: int, dtype: Any = jnp.float32) -> jax.Array:
    """``[capacity]`` vector with ones at positions ``< rank`` and zeros elsewhere."""
    return (jnp.arange(capacity) < rank).astype(dtype)


def cutoff_rank(s: jax.Array, cutoff: float) -> jax.Array:
    r"""Number of singular values above ``cutoff * s[0]`` (at least one).

    The reference's ``1 + last index i with s[i] > cutoff * s[0]``; singular values are sorted,
    so this is a count. A zero matrix gets rank 1 (the reference indexes an empty array there).
    """
    return jnp.maximum(jnp.sum(s > cutoff * s[0]), 1).astype(jnp.int32)


def _thin_svd(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return jnp.linalg.svd(w, full_matrices=False)


def svd(w: jax.Array, *, in_branch: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thin SVD in ``float32`` (as the reference), ``(u [m, n], s [n], vh [n, n])``.

    Inside ``shard_map`` on a value that varies over mesh axes, the SVD runs in a nested
    ``shard_map`` with ``check_vma=False`` and its results are cast back to varying. This works
    around a JAX limitation (jax 0.10.2): the TPU lowering of ``jnp.linalg.svd`` (the QDWH
    iteration) starts its loop carry with an unvarying ``True`` and fails with "scan body
    function carry input and carry output must have equal types ... bool[]{V:axis}" on varying
    inputs (``tests/upstream/test_tpu_svd_varying.py``). Nothing is communicated either way.

    ``in_branch``: the SVD sits in a branch of a ``lax.cond``/``lax.switch`` that also returns
    other state (the optax transform's step-kind ``switch``): on CPU its operand is then a
    copy of its own (:func:`jaxcomp._cpu._layouts.own_layout`, through the door's hook: one
    ``m n^2`` product more per re-factorisation, and no state copied into LAPACK's layout by
    the other branches); elsewhere nothing changes.
    """
    w = w.astype(jnp.float32)
    fn = _thin_svd
    if in_branch:
        own = lambda x: _thin_svd(_layouts.own_layout(x))  # noqa: E731
        fn = lambda x: _cpu.kernel(x, cpu=own, default=_thin_svd)  # noqa: E731
    axes = tuple(sorted(varying_axes(w)))
    if not axes:
        return fn(w)
    local = jax.shard_map(
        fn, mesh=get_abstract_mesh(), in_specs=P(), out_specs=P(),
        axis_names=frozenset(), check_vma=False,
    )  # fmt: skip
    # check_vma=False types the results as unvarying although they differ between workers:
    # restore the truth at once (a later collective would otherwise treat them as equal).
    return to_varying(local(w), axes)


#: Weights whose max-abs exceeds this are factorised from ``W * 2**-64`` (:func:`scaled_svd`).
SHRINK_ABOVE = 2.0**64


def scaled_svd(
    w: jax.Array, *, in_branch: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    r""":func:`svd` of :math:`kW`: ``(u, s, vh, k)``, the singular values of ``W`` being ``s / k``.

    :math:`k = 2^{-64}` when :math:`\max|W| > 2^{64}`, else 1 (bit-identical to :func:`svd`).
    A power of two is exact, and it keeps the singular values finite: those of a float32
    ``W`` near ``3e38`` exceed the largest float32 (a 8 x 4 matrix of ``3e38``: :math:`\sigma_0
    \approx 1.7\cdot10^{39}`), which made them Inf, the kept rank 1 whatever the cutoff, and
    the factors Inf/NaN. Pass ``k`` to :func:`factors_from_svd`. (Small weights need nothing:
    LAPACK scales them itself; ``1e-30`` factorises like ``1``.)
    """
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), initial=0.0)
    k = jnp.where(amax > SHRINK_ABOVE, 1.0 / SHRINK_ABOVE, 1.0).astype(jnp.float32)
    return (*svd(w * k, in_branch=in_branch), k)


def factors_from_svd(
    u: jax.Array,
    s: jax.Array,
    vh: jax.Array,
    rank: jax.Array,
    capacity: int,
    *,
    split_sigma: bool,
    sigma_on_a: jax.Array | bool,
    dtype: Any,
    scale: jax.Array | float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``(A [m, capacity], B [capacity, n])`` of rank ``rank`` from an SVD.

    Args:
      u, s, vh: the thin SVD of the tall view times ``scale`` (:func:`scaled_svd`).
      rank: kept rank (``<= capacity``), may be traced.
      capacity: static number of stored columns of ``A`` / rows of ``B``.
      split_sigma: put :math:`\\sqrt{\\Sigma}` on both factors.
      sigma_on_a: if not ``split_sigma``: whether :math:`\\Sigma` goes to ``A`` (A-trainers)
        or ``B`` (B-trainers); may be traced.
      dtype: dtype of the returned factors.
      scale: the ``k`` of :func:`scaled_svd` (a power of two; 1: ``s`` are the singular
        values). With ``split_sigma`` the factors hold :math:`\\sqrt{\\sigma_i}`, finite for any
        float32 ``W``; without, a factor holds :math:`\\sigma_i` itself, which for ``W`` near
        ``3e38`` may exceed the largest float32: that factor is then Inf (not representable;
        ``parallel.ab_data_parallel``'s ``finite`` metric reports it, the trainer skips it).
    """
    keep = rank_mask(rank, capacity)
    s = s[:capacity] * keep
    u, vh = u[:, :capacity] * keep, vh[:capacity] * keep[:, None]
    if split_sigma:
        root = jnp.sqrt(s) / jnp.sqrt(scale)  # sqrt(2**-64) = 2**-32: exact
        a, b = u * root, root[:, None] * vh
    else:
        s = s / scale
        a = jnp.where(sigma_on_a, u * s, u)
        b = jnp.where(sigma_on_a, vh, s[:, None] * vh)
    return a.astype(dtype), b.astype(dtype)


class FactorGrads(NamedTuple):
    """Both factors' gradients of one factorised parameter, ``[m, c]`` and ``[c, n]``, where the
    factorised forward (:mod:`._forward`) gives them instead of the dense gradient."""

    a: jax.Array
    b: jax.Array


def factor_grad(role: str, g: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``dL/dA = G Bᵀ`` (``role="a"``) or ``dL/dB = Aᵀ G`` (``"b"``), ``G`` the tall gradient.

    On CPU ``Aᵀ`` is written out first (:func:`jaxcomp._cpu._layouts.written_transpose`,
    through the door's hook: the product then runs on a faster kernel; the sums run in
    another order, equal up to rounding).
    """
    if role == "a":
        return g @ b.T
    at = _cpu.kernel(a, cpu=_layouts.written_transpose, default=lambda a: a.T)
    return at @ g


def reconstruct(a: jax.Array, b: jax.Array, spec: FactorSpec) -> jax.Array:
    """The dense parameter ``A·B`` in its original shape."""
    return from_matrix(a @ b, spec)


def resize_rank_axis(x: jax.Array, capacity: int, axis: int) -> jax.Array:
    """Truncates or zero-pads ``x`` along ``axis`` to ``capacity`` entries.

    The reference's ``pad_or_truncate_tensor`` for optimizer moments when ranks change.
    """
    size = x.shape[axis]
    if capacity <= size:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, capacity - size)
    return jnp.pad(x, pad)


#: Optimizer-state fields that hold first moments (linear in the gradient, so a singular
#: vector's sign flip flips them); other factor-shaped fields (Adam's ``nu``, ...) are only moved.
FIRST_MOMENTS = ("mu", "trace", "momentum", "m", "exp_avg")


def _field_name(path: Sequence[Any]) -> str | None:
    for k in reversed(path):
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if isinstance(name, str):
            return name
    return None


def map_moments(
    tree: Any, like: Sequence[jax.Array], fn: Callable[[int, jax.Array, bool], Any]
) -> Any:
    """Applies ``fn(i, leaf, first_moment)`` to every subtree of ``tree`` shaped like ``like``.

    Optimizer states (``optax.scale_by_adam``'s ``mu`` and ``nu``, momentum traces, ...) hold
    one subtree per parameter tree; for the tuple of factors those subtrees have the tuple's
    structure and shapes. Counters, hyperparameters and other leaves are left alone. This is
    the generic form of the reference's ``change_adam_shapes`` (which knows Adam's and SGD's
    buffers by name).

    Args:
      tree: an optimizer state.
      like: the factor tuple the state was initialised for.
      fn: called as ``fn(index_in_like, leaf, first_moment)``; ``first_moment`` tells whether
        the subtree's field is one of :data:`FIRST_MOMENTS`.

    Returns:
      ``tree`` with the matching subtrees replaced.
    """
    like = tuple(like)
    if not like:
        return tree
    like_def = jax.tree.structure(like)
    shapes = [tuple(x.shape) for x in like]

    def matches(node: Any) -> bool:
        if not isinstance(node, tuple) or len(node) != len(like):
            return False
        leaves, treedef = jax.tree.flatten(node)
        return treedef == like_def and [tuple(getattr(x, "shape", ())) for x in leaves] == shapes

    def apply(path: Any, node: Any) -> Any:
        if matches(node):
            first = _field_name(path) in FIRST_MOMENTS
            return tuple(fn(i, x, first) for i, x in enumerate(node))
        return node

    return jax.tree_util.tree_map_with_path(apply, tree, is_leaf=matches)


def map_like(tree: Any, like: Sequence[jax.Array], fn: Callable[[int, jax.Array], Any]) -> Any:
    """:func:`map_moments` without the first-moment flag: ``fn(index_in_like, leaf)``."""
    return map_moments(tree, like, lambda i, x, _: fn(i, x))


def match_columns(old_a: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""Which old factor column each new singular vector continues, and with which sign.

    With :math:`\hat a_j` the old ``A``'s columns normalised and :math:`u_i` the new left
    singular vectors, new vector ``i`` continues old column
    :math:`j_i = \arg\max_j |\hat a_j^\top u_i|` when that overlap exceeds :math:`1/\sqrt2`
    (then the match is one-to-one for orthonormal bases), with sign
    :math:`\operatorname{sign}(\hat a_{j_i}^\top u_i)`; otherwise it is a new direction
    (sign 0: its moments start at zero).

    Args:
      old_a: ``[m, c]``, the factor before the re-factorisation (zero columns allowed).
      u: ``[m, >= c]``, the new left singular vectors.

    Returns:
      ``(index int32[c], sign float32[c])`` with sign in ``{-1, 0, 1}``.
    """
    c = old_a.shape[-1]
    old = old_a.astype(jnp.float32)
    norm = jnp.linalg.norm(old, axis=0)
    dirs = old / jnp.where(norm > 0, norm, 1.0)
    overlap = dirs.T @ u[:, :c].astype(jnp.float32)  # [old, new]
    index = jnp.argmax(jnp.abs(overlap), axis=0).astype(jnp.int32)
    value = overlap[index, jnp.arange(c)]
    sign = jnp.where(jnp.abs(value) > 2**-0.5, jnp.sign(value), 0.0)
    return index, sign


def align_moment(
    x: jax.Array, index: jax.Array, sign: jax.Array, axis: int, first_moment: bool
) -> jax.Array:
    """Moves a moment's rank entries along ``axis`` to ``index`` and applies ``sign``.

    First moments take the sign; others (second moments) only ``|sign|`` (0 or 1).

    The entries are gathered one by one (``take_along_axis``), not as whole slices along
    ``axis`` (``take``): the same values, but the CPU backend lays a gather of columns out
    column-major, and in the optax transform's step-kind ``switch`` (where this runs in the
    re-factorisation branch) every other branch then copied the A factors' moments it passes
    through into that layout at every step (``jaxcomp._cpu._layouts.own_layout`` says why).
    """
    shape = [1] * x.ndim
    shape[axis] = -1
    size = list(x.shape)
    size[axis] = index.shape[0]
    moved = jnp.take_along_axis(x, jnp.broadcast_to(index.reshape(shape), size), axis=axis)
    factor = sign if first_moment else jnp.abs(sign)
    return (moved * factor.reshape(shape)).astype(x.dtype)
