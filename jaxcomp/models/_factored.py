r"""Flax ``nn.Dense`` layers computed from AB-Training's factors: the factorised forward's hook.

Give :func:`factored_dense` to :func:`jaxcomp.parallel.ab_data_parallel`
(``factored_forward=``): in its AB steps a ``Dense`` layer whose kernel is factorised computes
:math:`(x A) B` instead of :math:`x W` where that costs fewer multiply-adds
(:func:`jaxcomp.ab._forward.cheaper`), and its factor's gradient comes with the backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Mapping

import flax.linen as nn
from flax.linen import dtypes

from jaxcomp.ab._forward import Factors


def _dense_from_factors(module: nn.Dense, x, factors: Factors):
    """``module(x)`` (``nn.Dense``'s arithmetic: promoted dtypes, precision, bias) with the
    kernel's product taken through the factors."""
    bias = module.get_variable("params", "bias") if module.use_bias else None
    x, a, b, bias = dtypes.promote_dtype(x, factors.a, factors.b, bias, dtype=module.dtype)
    y = factors._replace(a=a, b=b).matmul(x, module.precision)
    if bias is not None:
        y += bias.reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def _plain(module: nn.Module) -> bool:
    """Whether ``module`` is a ``nn.Dense`` doing only what ``nn.Dense`` does (no subclass, no
    custom product or dtype promotion)."""
    return (
        type(module) is nn.Dense
        and module.dot_general is None
        and module.dot_general_cls is None
        and module.promote_dtype is dtypes.promote_dtype
    )


@contextlib.contextmanager
def factored_dense(factors: Mapping[int, Factors]) -> Iterator[None]:
    """While open, a Flax ``nn.Dense`` whose kernel is (by identity) a key of ``factors``
    computes its output from the factors, where :meth:`~jaxcomp.ab._forward.Factors.cheaper_for`
    its input; every other module runs as it is.

    Args:
      factors: ``{id(kernel): Factors}``, the kernels as the model reads them.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxcomp.ab._forward import Factors
      >>> a, b = jnp.ones((8, 2)), jnp.ones((2, 4))
      >>> kernel = a @ b
      >>> params = {"params": {"kernel": kernel, "bias": jnp.zeros(4)}}
      >>> with factored_dense({id(kernel): Factors(a, b, transposed=False)}):
      ...     y = nn.Dense(4).apply(params, jnp.ones((1, 8)))
      >>> y.tolist()
      [[16.0, 16.0, 16.0, 16.0]]
    """

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not _plain(module) or len(args) != 1 or kwargs:
            return next_fun(*args, **kwargs)
        kernel = module.get_variable("params", "kernel")
        found = factors.get(id(kernel)) if kernel is not None else None
        if found is None or not found.cheaper_for(args[0]):
            return next_fun(*args, **kwargs)
        return _dense_from_factors(module, args[0], found)

    with nn.intercept_methods(interceptor):
        yield
