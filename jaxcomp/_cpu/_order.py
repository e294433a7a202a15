"""Ordering and materialising values inside a compiled program, through data dependencies.

XLA schedules an operation as soon as its operands are ready and, on the CPU backend, proves
that a buffer's readers come before an in-place write to it only through data dependencies
(``lax.optimization_barrier`` does not order anything there: XLA:CPU expands it away).
:func:`after` gives ``x`` such a dependency on other values without changing a bit of it;
:func:`computed_once` makes a value a step of its own, written once where its readers read it,
instead of recomputed inside each of them. The module imports only JAX: every package (codecs
to trainer) may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _always_true(leaves) -> jax.Array | None:
    """A ``bool`` scalar read from the first entry of each non-empty leaf, true for every value
    (NaN included) and not folded by XLA; ``None`` without a non-empty leaf."""
    flag = None
    for leaf in leaves:
        if leaf.size:
            v = leaf.reshape(-1)[0].astype(jnp.float32)  # exact for every index dtype used
            v = (v == v) | (v != v)  # true for every value, NaN included; XLA does not fold it
            flag = v if flag is None else flag & v
    return flag


def after(x: jax.Array, deps: Any) -> jax.Array:
    r"""``x`` itself, computed after ``deps`` (a select on a flag read from them, always true).

    .. math::
      \mathrm{after}(x, d) = \mathrm{where}(f(d), x, \mathrm{NaN}), \quad
      f(d) = \bigwedge_{\ell \in d} (\ell_0 = \ell_0) \lor (\ell_0 \ne \ell_0) \equiv \mathrm{true}

    Uses: for a scalar ``x``, a value of its own for each payload (a zero broadcast that
    several scatters share is copied once per scatter by XLA:CPU); a collective moved to the
    end of a step (AB-Training's loss mean, after the new parameters); error feedback's
    ``c - echo`` written over ``c``, after the mean (fused into that pass). The select is one
    elementwise pass over ``x``, in place: to order a scatter into a large array after the
    reads of it, make the array with :func:`computed_once` instead (no pass). The values (NaN,
    -0.0 too) are ``x``'s (were the flag ever false, every value would be NaN; 0 for
    integers).

    Args:
      x: the value to order.
      deps: a pytree of arrays ``x`` must come after (empty leaves are ignored; no non-empty
        leaf: ``x`` is returned as is).

    Returns:
      ``x``, bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp._cpu import _order
      >>> _order.after(jnp.array([-0.0, jnp.nan]), {"idx": jnp.array([3], jnp.int32)})
      Array([-0., nan], dtype=float32)
    """
    flag = _always_true(jax.tree.leaves(deps))
    if flag is None:
        return x
    never = jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0
    return jnp.where(flag, x, jnp.full((), never, x.dtype))


def computed_once(fn: Callable[..., jax.Array], carry: jax.Array, *operands: Any) -> jax.Array:
    r"""``fn(carry, *operands)`` as a step of its own, written once into ``carry``'s buffer.

    .. math::
      \mathrm{computed\_once}(f, c, o_1, \dots) = f(c, o_1, \dots)

    XLA fuses a cheap elementwise producer into every reader that can take it, recomputing it
    there; error feedback's ``c = x + e`` was recomputed inside TopK's selection passes. Its
    new residual ``c - D(C(c))`` is a scatter of the kept values into ``c`` in place, so ``c``
    has to be written somewhere, and since the recomputing readers read ``e`` itself, XLA:CPU
    gave ``c`` a buffer of its own and copied the result into the donated ``e`` (8 MiB more
    temporaries and a full pass per leaf of the bench; ordering the scatter with :func:`after`
    avoided the copy with a select over every entry, also a full pass). Made the body of a
    loop that runs once, ``fn`` cannot be fused into its readers: it is computed once, written
    into ``carry``'s buffer where it is elementwise in ``carry`` (the donated residual), every
    reader reads that, and a scatter into it after its readers is in place. The trip count is
    read from the data (always one): XLA inlines a loop it knows runs once, body and all.

    Args:
      fn: ``fn(carry, *operands) -> array`` of ``carry``'s shape, dtype (and varying axes under
        ``shard_map``), without collectives.
      carry: the array whose buffer the result may take (e.g. a donated state).
      *operands: the other arrays ``fn`` reads.

    Returns:
      ``fn(carry, *operands)``, bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp._cpu import _order
      >>> _order.computed_once(lambda e, x: x + e, jnp.array([1.0, -0.0]), jnp.array([2.0, -0.0]))
      Array([ 3., -0.], dtype=float32)
    """
    if not carry.size:
        return fn(carry, *operands)
    # one entry of the first non-empty input (an operand's: carry's buffer is then read only
    # by the loop)
    first = next(leaf for leaf in [*jax.tree.leaves(operands), carry] if leaf.size)
    flag = _always_true([first])
    trips = flag.astype(jnp.int32)

    def body(state):
        done, value = state
        return done + 1, fn(value, *operands)

    start = (jnp.zeros((), jnp.int32), carry)
    return lax.while_loop(lambda state: state[0] < trips, body, start)[1]
