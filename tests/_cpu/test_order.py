"""_order.after: x bit for bit, ordered after its dependencies (also under jit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._cpu import _order

EDGES = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-10, -1e6, 3.5], np.float32)


@pytest.mark.user_numerics
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_values_pass_bit_for_bit_eager_and_jit(dtype):
    x = jnp.asarray(EDGES if dtype != jnp.int32 else np.arange(-4, 5), dtype)
    deps = {"idx": jnp.array([7, 2], jnp.int32), "val": jnp.array([np.nan], jnp.float32)}
    want = np.asarray(x).tobytes()
    assert np.asarray(_order.after(x, deps)).tobytes() == want
    assert np.asarray(jax.jit(_order.after)(x, deps)).tobytes() == want


def test_without_a_non_empty_dependency_x_is_returned_as_is():
    x = jnp.ones(3)
    assert _order.after(x, {}) is x
    assert _order.after(x, [jnp.zeros((0,))]) is x


def test_the_result_depends_on_the_dependencies_in_the_program():
    def f(x, d):
        return _order.after(x, d)

    hlo = jax.jit(f).lower(jnp.ones(4), jnp.ones(2, jnp.int32)).as_text()
    assert "select" in hlo  # a select on a flag read from d, not folded away
