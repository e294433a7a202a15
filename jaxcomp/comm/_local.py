"""Per-worker gradients inside ``shard_map`` without the hidden all-reduce.

``jax.grad`` with respect to a parameter that is *replicated* (invariant) over a mesh axis
inserts an uncompressed ``float32`` all-reduce over that axis: the transpose of the implicit
broadcast is a ``psum`` (JAX-NOTES §1). Casting the parameters to *varying* first keeps the
gradients local, so a compressed reduction can follow.

A Flax NNX module is no exception: ``nnx.value_and_grad`` of a module whose parameters are
replicated over the data axis inserts the same all-reduce. :func:`local_value_and_grad` takes a
module argument too: its ``nnx.Param`` variables are cast to varying on a copy, the gradient is
taken as ``nnx.value_and_grad`` takes it (an ``nnx.State`` of the parameters), and the module's
other state (BatchNorm statistics) is written back into the caller's module.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from jaxcomp import _nnx
from jaxcomp.compressors._protocol import to_varying
from jaxcomp.compressors._protocol import varying_axes

__all__ = ("local_value_and_grad", "to_varying", "varying_axes")


def local_value_and_grad(
    fun: Callable[..., Any],
    axes: str | Sequence[str],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` for use inside ``shard_map`` that returns *per-worker* gradients.

    The differentiated arguments are cast to varying over ``axes`` first, so no collective over
    ``axes`` is inserted and each worker gets the gradient of its own loss. Reduce them
    yourself, e.g. with :func:`jaxcomp.transforms.compressed_mean`.

    A differentiated argument may be a Flax ``nnx.Module`` (``fun(model, batch)``): the
    gradient is then with respect to its ``nnx.Param`` variables, an ``nnx.State``, as
    ``nnx.value_and_grad`` gives it, and the module's other state (e.g. BatchNorm statistics)
    is updated in place as ``fun`` leaves it. The module's own parameters are not touched:
    the varying copy is what ``fun`` sees.

    Args:
      fun: the loss, as for ``jax.value_and_grad``.
      axes: the data-parallel mesh axis name(s).
      argnums: which arguments to differentiate.
      has_aux: as for ``jax.value_and_grad``.

    Returns:
      A function with ``jax.value_and_grad``'s signature and outputs.

    Example:
      >>> # inside shard_map(..., in_specs=(P(), P("data"))):
      >>> # loss, grads = local_value_and_grad(loss_fn, "data")(params, batch)  # no all-reduce
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    grad_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        args = list(args)
        modules = []
        for i in nums:
            if _nnx.is_module(args[i]):
                copy = _nnx.with_params(args[i], lambda p: to_varying(p, axes))
                modules.append((args[i], copy))
                args[i] = copy
            else:
                args[i] = to_varying(args[i], axes)
        if not modules:
            return grad_fn(*args, **kwargs)
        out = _nnx.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)
        for model, copy in modules:  # BatchNorm statistics and the like, as fun left them
            _nnx.update(model, _nnx.rest_of(copy))
        return out

    return wrapped
