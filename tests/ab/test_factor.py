"""AB-Training factorisation: layout, 2-D views, SVD split, factor gradients, moment surgery."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomp.ab import _factor as F
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._layout import name_matches

SHAPES = [(12, 5), (5, 12), (3, 3, 4, 6), (3, 3, 2, 40)]


def _spec(shape):
    return build_layout({"w": jnp.zeros(shape)}).specs[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_matrix_view_is_tall_and_round_trips(shape):
    spec = _spec(shape)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    w = F.to_matrix(x, spec)
    assert w.shape == (spec.rows, spec.cols) and spec.rows >= spec.cols
    np.testing.assert_array_equal(F.from_matrix(w, spec), x)


def test_layout_classifies_and_excludes():
    params = {
        "Conv_0": {"kernel": jnp.zeros((3, 3, 3, 8)), "bias": jnp.zeros(8)},
        "Conv_1": {"kernel": jnp.zeros((3, 3, 8, 8))},
        "squeezable": jnp.zeros((1, 16)),
        "head": {"kernel": jnp.zeros((8, 10))},
    }
    layout = build_layout(params, exclude=("Conv_0", "head/kernel"))
    assert [s.path for s in layout.specs] == ["Conv_1/kernel"]
    assert len(layout.dense) == 4
    fac, dense = layout.split(params)
    assert jax.tree.structure(layout.merge(fac, dense)) == jax.tree.structure(params)


def test_unmatched_exclude_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"exclude: \['classifier'\] match no parameter"):
        build_layout({"Dense_0": {"kernel": jnp.zeros((4, 4))}}, exclude=("classifier",))


def test_name_matching_uses_whole_components():
    assert name_matches("features.0", "features/0/weight")
    assert name_matches("Conv_0", "params/Conv_0/kernel")
    assert not name_matches("Conv_0", "params/Conv_01/kernel")
    assert not name_matches("", "params/Conv_0/kernel")


SPLITS = [(True, True), (False, True), (False, False)]


@functools.cache
def _all_factors(shape):
    """One program per shape giving every ``(split_sigma, sigma_on_a)`` placement's factors
    and reconstruction (a program per case compiled the same SVD three times)."""
    spec = _spec(shape)

    @jax.jit
    def factors(x):
        u, s, vh = F.svd(F.to_matrix(x, spec))
        out = {}
        for split_sigma, sigma_on_a in SPLITS:
            a, b = F.factors_from_svd(
                u, s, vh, spec.cols, spec.cols, split_sigma=split_sigma, sigma_on_a=sigma_on_a,
                dtype=jnp.float32,
            )  # fmt: skip
            out[split_sigma, sigma_on_a] = a, b, F.reconstruct(a, b, spec)
        return out

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return x, jax.tree.map(np.asarray, factors(x))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("split_sigma,sigma_on_a", SPLITS)
def test_untruncated_factors_reproduce_the_weight(shape, split_sigma, sigma_on_a):
    spec = _spec(shape)
    x, out = _all_factors(shape)
    a, b, w = out[split_sigma, sigma_on_a]
    np.testing.assert_allclose(w, x, rtol=1e-5, atol=1e-5)
    if split_sigma:  # sqrt(Sigma) on both: A^T A == B B^T == Sigma
        np.testing.assert_allclose(a.T @ a, b @ b.T, rtol=1e-4, atol=1e-5)
    elif sigma_on_a:  # B = V^T is orthonormal
        np.testing.assert_allclose(b @ b.T, np.eye(spec.cols), atol=1e-5)
    else:  # A = U is orthonormal
        np.testing.assert_allclose(a.T @ a, np.eye(spec.cols), atol=1e-5)


def test_truncation_keeps_leading_singular_values_and_zeroes_the_rest():
    q1, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((6, 4)))
    q2, _ = np.linalg.qr(np.random.default_rng(2).standard_normal((4, 4)))
    w = (q1 * np.array([10.0, 5.0, 1.4, 1.0])) @ q2.T

    @jax.jit
    def truncate(w):
        u, s, vh = F.svd(w)
        rank = F.cutoff_rank(s, 0.15)  # 10 * 0.15 = 1.5: keeps 10 and 5
        a, b = F.factors_from_svd(u, s, vh, rank, 3, split_sigma=True, sigma_on_a=True,
                                  dtype=jnp.float32)  # fmt: skip
        return rank, a, b

    rank, a, b = truncate(w.astype(np.float32))
    assert int(rank) == 2
    assert a.shape == (6, 3) and b.shape == (3, 4)
    np.testing.assert_array_equal(a[:, 2], 0.0)
    np.testing.assert_array_equal(b[2], 0.0)
    s = np.linalg.svd(np.asarray(a) @ np.asarray(b), compute_uv=False)
    np.testing.assert_allclose(s, [10, 5, 0, 0], atol=1e-4)


def test_cutoff_rank_of_a_zero_matrix_is_one():
    assert int(F.cutoff_rank(jnp.zeros(4), 0.15)) == 1


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (3, 3, 4, 6)])
def test_factor_gradients_equal_jax_grad_of_the_factored_model(shape):
    spec = _spec(shape)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((spec.rows, 3)).astype(np.float32)
    b = rng.standard_normal((3, spec.cols)).astype(np.float32)
    target = rng.standard_normal(shape).astype(np.float32)

    def loss_dense(w):
        return jnp.sum(jnp.sin(w) * target)

    def loss_factored(a, b):
        return loss_dense(F.reconstruct(a, b, spec))

    @jax.jit
    def both(a, b):
        g = F.to_matrix(jax.grad(loss_dense)(F.reconstruct(a, b, spec)), spec)
        ours = F.factor_grad("a", g, a, b), F.factor_grad("b", g, a, b)
        return ours, jax.grad(loss_factored, argnums=(0, 1))(a, b)

    (da, db), (ref_a, ref_b) = both(a, b)
    np.testing.assert_allclose(da, ref_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, ref_b, rtol=1e-5, atol=1e-5)


def test_resize_pads_with_zeros_and_truncates():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(F.resize_rank_axis(x, 5, -1), [[0, 1, 2, 0, 0], [3, 4, 5, 0, 0]])
    np.testing.assert_array_equal(F.resize_rank_axis(x, 1, -2), [[0, 1, 2]])


def test_map_like_touches_moments_not_counters():
    factors = (jnp.ones((4, 3)), jnp.ones((3, 2)))
    opt = optax.chain(optax.scale_by_adam(), optax.trace(0.9))
    state = opt.init(factors)
    out = F.map_like(state, factors, lambda i, x: F.resize_rank_axis(x, 1, -1 - i))
    adam, trace = out
    assert adam.count.shape == ()
    assert [x.shape for x in adam.mu] == [(4, 1), (1, 2)]
    assert [x.shape for x in adam.nu] == [(4, 1), (1, 2)]
    assert [x.shape for x in trace.trace] == [(4, 1), (1, 2)]
