"""_order.computed_once, which error feedback makes ``c = x + e`` with before TopK scatters into
it: ``fn``'s values bit for bit (eager, jit, vmap, shard_map), and a loop XLA keeps.

XLA inlines a while loop whose trip count it knows to be one, and fuses the body into its
readers again; the trip count is read from the data. ``test_ef21_in_place`` checks that the
error-feedback step has no copy of the residual, ``test_reduction_bits`` its formula.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp._cpu import _order

EDGES = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-10, -1e6, 3.5], np.float32)


def _add(e, x):
    return x + e


def _bits(a):
    return np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


@pytest.mark.user_numerics
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_are_fns_bit_for_bit_eager_jit_and_vmap(dtype):
    # x's first entry is NaN (the trip count is read from it); -0.0 + -0.0 stays -0.0,
    # inf - inf is NaN, and NaN payloads pass as the add makes them
    x = jnp.asarray(EDGES, dtype)
    e = jnp.asarray(np.roll(EDGES, 3) * np.float32(-1.0), dtype).at[1].set(-0.0)
    want = _bits(_add(e, x))
    assert (_bits(_order.computed_once(_add, e, x)) == want).all()
    assert (_bits(jax.jit(lambda e, x: _order.computed_once(_add, e, x))(e, x)) == want).all()
    batched = jax.vmap(lambda e, x: _order.computed_once(_add, e, x))(e[None], x[None])
    assert (_bits(batched[0]) == want).all()


def test_an_empty_carry_is_fn_itself():
    e = jnp.zeros((0, 3))
    out = _order.computed_once(lambda e, x: e + 1.0, e, jnp.zeros((0,)))
    assert out.shape == (0, 3)


def test_the_compiled_program_keeps_the_loop():
    # XLA:CPU inlines a loop it knows runs once (and makes a tiny one a call): 4096 entries
    def f(e, x):
        c = _order.computed_once(_add, e, x)
        return c.at[jnp.argmax(c)].set(jnp.sum(c))  # readers, then a scatter into c

    e, x = np.arange(4096, dtype=np.float32), np.ones(4096, np.float32)
    compiled = jax.jit(f, donate_argnums=0).lower(e, x).compile()
    assert " while(" in compiled.as_text()  # the trip count is read from x: not known
    want = (e + x).copy()
    want[-1] = np.sum(e + x)
    np.testing.assert_array_equal(compiled(jnp.asarray(e), x), want)


def test_varying_under_shard_map():
    mesh = comm.make_mesh([(comm.DATA, 2)], devices=jax.devices()[:2])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    e = np.full((2, 4), -0.5, np.float32)

    @jax.jit
    def f(e, x):
        body = lambda e, x: _order.computed_once(_add, e, x)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P(comm.DATA), out_specs=P(comm.DATA))(e, x)

    np.testing.assert_array_equal(f(e, x), x + e)
