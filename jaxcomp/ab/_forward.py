r"""AB-Training's factorised forward: a factorised layer computed as :math:`(x A) B`.

In an AB step the model's factorised weights are :math:`W = A B` (the tall view, :mod:`._layout`)
and only one factor trains. Through the dense weight, a step costs the layer's forward and
backward at full width and the factor's gradient :math:`G B^\top` or :math:`A^\top G` of the
dense gradient :math:`G`; through the factors, the layer computes :math:`(x A) B` and automatic
differentiation gives the factors' gradients directly. With :math:`b` rows through a layer of
kernel :math:`[m_{in}, n_{out}]` at rank capacity :math:`c`, in multiply-adds per step:

.. math::
  \text{dense: } 3 b\, m n + m n c \qquad\qquad \text{factorised: } 3 b\, c\, (m + n)

(forward, input gradient and weight or factor gradients; :math:`W = A B` itself, formed at
the end of every AB step for the parameters, is the same on both sides). :func:`cheaper`
compares the two; the digits MLP's 256 x 256 layers at capacity 64 and 16 rows: 7.3M -> 1.6M.

The grouped step (:mod:`._programs`) does not know the model: a *forward hook* does, a
function ``hook(factors) -> context manager`` that, while the context is open, computes each
layer whose kernel is (by identity: ``id(kernel)``) a key of ``factors`` from its
:class:`Factors` where :func:`cheaper` says so (:func:`jaxcomp.models.factored_dense`: Flax's
``nn.Dense``). :func:`value_and_grads` differentiates the loss with respect to the factors and
the non-factorised parameters, handing the loss ``W = A B`` built from the factors: a layer
the hook computes leaves that product unread (compiled away), and any other reader of the
weight (a layer the hook leaves alone, a regulariser) differentiates through it, so the
gradients are exact wherever the hook applies. The numbers are the dense path's up to the
order of float summation: :math:`(x A) B` and :math:`x (A B)`, :math:`x^\top (\delta B^\top)`
and :math:`(x^\top \delta) B^\top` are the same sums grouped differently.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
from jax import lax

from jaxcomp.ab import _factor as F
from jaxcomp.ab._layout import ABLayout
from jaxcomp.comm import local_value_and_grad

#: ``hook(factors: Mapping[int, Factors]) -> ContextManager``: while open, the model computes
#: each layer whose kernel's ``id`` is a key of ``factors`` from them, where :func:`cheaper`.
ForwardHook = Callable[[Mapping[int, "Factors"]], contextlib.AbstractContextManager]


def cheaper(rows: int, m: int, n: int, capacity: int) -> bool:
    """Whether a layer of kernel ``[m, n]`` costs fewer multiply-adds per AB step computed from
    factors of capacity ``capacity`` (``3 rows c (m + n)``) than through the dense weight and
    the factor gradient (``3 rows m n + m n c``), for ``rows`` rows through it."""
    return 3 * rows * capacity * (m + n) < 3 * rows * m * n + m * n * capacity


class Factors(NamedTuple):
    """One factorised 2-D kernel ``[in, out]`` as a layer may use it.

    Attributes:
      a: ``[m, c]``, the tall view's ``A``.
      b: ``[c, n]``, its ``B``.
      transposed: whether the kernel is the tall view's transpose (``in < out``): the kernel
        is ``(A B)^T`` instead of ``A B``.
    """

    a: jax.Array
    b: jax.Array
    transposed: bool

    @property
    def capacity(self) -> int:
        return self.a.shape[-1]

    def cheaper_for(self, x: jax.Array) -> bool:
        """:func:`cheaper` for the rows of ``x`` (every axis but the last)."""
        rows = math.prod(x.shape[:-1])
        return cheaper(rows, self.a.shape[0], self.b.shape[-1], self.capacity)

    def matmul(self, x: jax.Array, precision: Any = None) -> jax.Array:
        """``x @ kernel`` over ``x``'s last axis, without forming the kernel: ``(x A) B``, or
        ``(x B^T) A^T`` for a transposed kernel. ``a`` and ``b`` in the caller's dtype."""
        first, second = (self.b, self.a) if self.transposed else (self.a, self.b)
        # contract x's last axis with the factor's rows (or columns, for a transposed kernel)
        axis = 1 if self.transposed else 0
        last = x.ndim - 1
        y = lax.dot_general(x, first, (((last,), (axis,)), ((), ())), precision=precision)
        return lax.dot_general(y, second, (((last,), (axis,)), ((), ())), precision=precision)


def value_and_grads(
    hook: ForwardHook,
    loss_fn: Callable[..., Any],
    axes: tuple[str, ...],
    layout: ABLayout,
    params: Any,
    a: tuple[jax.Array, ...],
    b: tuple[jax.Array, ...],
    *rest: Any,
) -> tuple[Any, tuple, tuple[F.FactorGrads, ...]]:
    """``loss_fn(params, *rest)`` (``(loss, aux)``) and its per-worker gradients with respect to
    the non-factorised parameters and to the factors, the factorised weights built from
    ``a`` and ``b`` and the model run inside ``hook``.

    Args:
      hook: the forward hook (see the module docstring).
      loss_fn: ``loss_fn(params, *rest) -> (loss, aux)``.
      axes: the workers' mesh axes (the gradients stay local: no collective over them).
      layout: the parameters' :class:`~._layout.ABLayout`.
      params: the parameters (their factorised leaves are not read).
      a, b: the factors, one per factorised parameter.
      *rest: ``loss_fn``'s other arguments.

    Returns:
      ``((loss, aux), other_grads, factor_grads)``: the non-factorised parameters' gradients
      in layout order, one :class:`~._factor.FactorGrads` per factorised parameter.
    """
    _, other = layout.split(params)

    def fn(other, a, b, *rest):
        weights = tuple(F.reconstruct(x, y, s) for x, y, s in zip(a, b, layout.specs))
        factors = {
            id(w): Factors(x, y, s.transposed)
            for w, x, y, s in zip(weights, a, b, layout.specs)
            if len(s.shape) == 2
        }
        with hook(factors):
            return loss_fn(layout.merge(weights, other), *rest)

    grad_fn = local_value_and_grad(fn, axes, argnums=(0, 1, 2), has_aux=True)
    out, (g_other, g_a, g_b) = grad_fn(other, a, b, *rest)
    return out, g_other, tuple(F.FactorGrads(x, y) for x, y in zip(g_a, g_b))
