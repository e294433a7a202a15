"""PowerSGD codec: exactness on rank-r matrices, equality with a numpy reference, warm start."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors

KEY = jax.random.key(0)


def np_orthogonalize(p, eps=1e-8):
    p = p.copy()
    for i in range(p.shape[1]):
        for j in range(i):
            p[:, i] -= np.dot(p[:, j], p[:, i]) * p[:, j]
        p[:, i] /= np.sqrt(np.dot(p[:, i], p[:, i])) + eps
    return p


@pytest.mark.parametrize("shape, rank", [((12, 9), 1), ((12, 9), 3), ((3, 4, 10), 2)])
def test_exact_on_rank_r_matrices(shape, rank):
    rows, cols = compressors.matrix_shape(shape)
    k1, k2 = jax.random.split(KEY)
    m = jax.random.normal(k1, (rows, rank)) @ jax.random.normal(k2, (rank, cols))
    x = m.reshape(shape)
    codec = compressors.power_sgd(rank)
    payload, _ = codec.compress(x, codec.init(x), None)
    np.testing.assert_allclose(codec.decompress(payload, x), x, rtol=1e-4, atol=1e-4)
    assert compressors.wire_bytes(payload) == 4 * (rows + cols) * rank


def test_matches_numpy_reference_over_steps_with_warm_start():
    codec = compressors.power_sgd(2, seed=3)
    xs = jax.random.normal(KEY, (4, 10, 6))
    state = codec.init(xs[0])
    q = np.asarray(jax.random.normal(jax.random.key(3), (6, 2)))
    np.testing.assert_allclose(state.q, q)
    step = jax.jit(lambda x, s: codec.compress(x, s, None))
    for x in xs:
        payload, state = step(x, state)
        m = np.asarray(x, np.float64)
        p = np_orthogonalize(m @ q)
        q = m.T @ p
        np.testing.assert_allclose(payload.p, p, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(payload.q, q, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(state.q, q, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(codec.decompress(payload, x), p @ q.T, rtol=2e-4, atol=2e-4)


def test_warm_start_converges_to_top_singular_subspace():
    u, _ = np.linalg.qr(np.asarray(jax.random.normal(KEY, (30, 20))))
    v, _ = np.linalg.qr(np.asarray(jax.random.normal(jax.random.key(1), (20, 20))))
    x = jnp.asarray((u * (4.0 / (1.0 + np.arange(20)))) @ v.T, jnp.float32)  # clear spectral gap
    codec = compressors.power_sgd(2)
    step = jax.jit(lambda s: codec.compress(x, s, None))
    state = codec.init(x)
    for _ in range(40):
        payload, state = step(state)
    u, s, vt = np.linalg.svd(np.asarray(x))
    best = (u[:, :2] * s[:2]) @ vt[:2]
    np.testing.assert_allclose(codec.decompress(payload, x), best, atol=2e-3)


def test_one_dimensional_passes_through_and_zeros_stay_zero():
    codec = compressors.power_sgd(2)
    v = jnp.arange(5.0)
    payload, state = codec.compress(v, codec.init(v), None)
    np.testing.assert_array_equal(codec.decompress(payload, v), v)
    assert state.q.shape == (0, 0)
    z = jnp.zeros((6, 4))
    state = codec.init(z)
    payload, new_state = codec.compress(z, state, None)
    np.testing.assert_array_equal(codec.decompress(payload, z), np.zeros((6, 4)))
    # a dead Q column would freeze the iteration forever; the old one is kept instead
    np.testing.assert_array_equal(new_state.q, state.q)


def test_without_warm_start_q_comes_from_the_key():
    codec = compressors.power_sgd(1, warm_start=False)
    assert codec.stochastic
    x = jax.random.normal(KEY, (5, 4))
    with pytest.raises(ValueError, match="key"):
        codec.compress(x, codec.init(x), None)
    p1, _ = codec.compress(x, codec.init(x), jax.random.key(1))
    p2, _ = codec.compress(x, codec.init(x), jax.random.key(1))
    np.testing.assert_array_equal(p1.p, p2.p)


def test_orthogonalize_gives_orthonormal_columns():
    p = compressors.orthogonalize(jax.random.normal(KEY, (20, 4)))
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(rank=1.5), dict(epsilon=-1.0)])
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError, match="rank|epsilon"):
        compressors.power_sgd(**kwargs)
