"""Ordering a value after others inside a compiled program, through a data dependency.

XLA schedules an operation as soon as its operands are ready and, on the CPU backend, proves
that a buffer's readers come before an in-place write to it only through data dependencies
(``lax.optimization_barrier`` does not order anything there: XLA:CPU expands it away).
:func:`after` gives ``x`` such a dependency on other values without changing a bit of it. The
module imports only JAX: every package (codecs to trainer) may use it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def after(x: jax.Array, deps: Any) -> jax.Array:
    r"""``x`` itself, computed after ``deps`` (a select on a flag read from them, always true).

    .. math::
      \mathrm{after}(x, d) = \mathrm{where}(f(d), x, \mathrm{NaN}), \quad
      f(d) = \bigwedge_{\ell \in d} (\ell_0 = \ell_0) \lor (\ell_0 \ne \ell_0) \equiv \mathrm{true}

    Uses: a scatter into ``x`` in place once a codec's payload ``deps`` is made, where ``x``
    is also what was compressed (error feedback: ``c - D(C(c))`` with TopK's kept values
    subtracted from ``c``): without the dependency XLA:CPU copies the donated buffer ``x``
    lives in (and duplicates ``x``'s producer). For a scalar ``x`` it also gives each payload a
    value of its own (a zero broadcast that several scatters share is copied once per scatter
    by XLA:CPU). And a collective moved to the end of a step (AB-Training's loss mean, after
    the new parameters). The select is one elementwise pass, in place; the values (NaN, -0.0
    too) are ``x``'s (were the flag ever false, every value would be NaN; 0 for integers).

    Args:
      x: the value to order.
      deps: a pytree of arrays ``x`` must come after (empty leaves are ignored; no non-empty
        leaf: ``x`` is returned as is).

    Returns:
      ``x``, bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import _order
      >>> _order.after(jnp.array([-0.0, jnp.nan]), {"idx": jnp.array([3], jnp.int32)})
      Array([-0., nan], dtype=float32)
    """
    flag = None
    for leaf in jax.tree.leaves(deps):
        if leaf.size:
            v = leaf.reshape(-1)[0].astype(jnp.float32)  # exact for every index dtype used
            v = (v == v) | (v != v)  # true for every value, NaN included; XLA does not fold it
            flag = v if flag is None else flag & v
    if flag is None:
        return x
    never = jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0
    return jnp.where(flag, x, jnp.full((), never, x.dtype))
