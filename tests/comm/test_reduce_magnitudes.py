"""Means near float32's limits on every reduction path, against a float64 mean.

With W workers holding arrays near ``3e38 / W`` and above, ``sum / W`` overflowed to inf where
the mean is finite. PowerSGD's ``psum``s are exact there since session 16 (small factors,
scaled by a power of two); the paths that sum whole arrays (``dense``'s ``pmean``, ``psum``,
``all_gather``, ``two_phase``) give inf where the float32 sum overflows, never a finite wrong
mean (a prescale cost the dense mean 8-11% and flushed terms near 1e-38; a rescue pass cost EF
+ quantize a leaf-sized temporary)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors

pytestmark = pytest.mark.user_numerics

SHAPE = (16, 32)
# max |x| over the workers: 6.1 * magnitude (3.1e38 at 5e37); the sum of 8 overflows from 1e37
MAGNITUDES = (1e-30, 1.0, 1e30, 1e37, 5e37)


def _workers(num):
    """``[num, *SHAPE]``: one pattern times 1 + 0.1 w, so that the terms do not cancel."""
    x = np.random.default_rng(0).standard_normal(SHAPE)
    return np.stack([x * (1 + 0.1 * w) for w in range(num)])


def _top_half_workers(num):
    """:func:`_workers` with all but the largest half of each worker's entries zeroed: what
    ``top_k(0.5)`` keeps, so its decoded mean is the mean of these."""
    x = _workers(num).reshape(num, -1)
    drop = np.argsort(np.abs(x), axis=1)[:, : x.shape[1] // 2]
    np.put_along_axis(x, drop, 0.0, axis=1)
    return x.reshape(num, *SHAPE)


def _low_rank_workers(num):
    """``M_w = u v_w^T``: one left factor, so PowerSGD's rank-1 mean is the exact mean."""
    rng = np.random.default_rng(1)
    u, v = rng.standard_normal(SHAPE[0]), rng.standard_normal(SHAPE[1])
    v = np.stack([v * (1 + 0.1 * w) + 0.1 * rng.standard_normal(SHAPE[1]) for w in range(num)])
    return np.einsum("i,wj->wij", u, v) / 3


@functools.cache  # one program per codec object, path and worker count for the module
def _reducer(codec, path, num):
    mesh = comm.make_mesh([(comm.DATA, num)], devices=jax.devices()[:num])

    def body(x):
        x = x[0]
        protocol = comm.plan_reduce(codec, x, path=path, min_compression_rate=0)
        state = protocol.init(x, num)
        mean, _, state = comm.compressed_pmean(x, protocol, state, jax.random.key(1), comm.DATA)
        bad = sum(jnp.sum(~jnp.isfinite(leaf)) for leaf in jax.tree.leaves(state))
        return mean, jax.lax.psum(bad, comm.DATA)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(comm.DATA), out_specs=P()))
    return lambda g: fn(jax.device_put(g, NamedSharding(mesh, P(comm.DATA))))


CASES = {
    "power_sgd1": (compressors.power_sgd(1), "codec", _low_rank_workers),
    "power_sgd2": (compressors.power_sgd(2), "codec", _low_rank_workers),
}


@pytest.mark.parametrize("num", [8, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_mean_is_exact_up_to_float32s_largest(name, num):
    codec, path, data = CASES[name]
    fn = _reducer(codec, path, num)
    base = data(num)
    for magnitude in MAGNITUDES:
        g = np.asarray(base * magnitude, np.float32)
        want = g.astype(np.float64).mean(0)
        assert np.isfinite(want).all() and np.abs(g).max() > magnitude
        mean, bad = fn(g)
        mean = np.asarray(mean, np.float64)
        rtol = 1e-5 if path == "codec" else 1e-6
        np.testing.assert_allclose(mean, want, rtol=rtol, atol=0, err_msg=f"{magnitude:g}")
        assert int(bad) == 0  # every state finite (PowerSGD's warm start, residuals)


@pytest.mark.parametrize("rank", [1, 2])
def test_power_sgd_beyond_its_range_is_loud(rank):
    """Documented limit: a worker whose own ``M Q`` or ``M^T P`` overflows (max|M| near
    ``3e38 / cols``) gives a non-finite mean and keeps its warm start, never a finite one."""
    fn = _reducer(CASES[f"power_sgd{rank}"][0], "codec", 8)  # the program of the test above
    g = np.asarray(_low_rank_workers(8) * 1.5e38, np.float32)
    mean, bad = fn(g)
    assert not np.isfinite(np.asarray(mean)).all() and int(bad) == 0


LOUD = {
    "dense": (compressors.identity(), "dense", _workers),
    "psum": (compressors.identity(), "psum", _workers),
    "all_gather": (compressors.identity(), "all_gather", _workers),
    "all_gather_top_k": (compressors.top_k(0.5), "all_gather", _top_half_workers),
    "two_phase": (compressors.identity(), "two_phase", _workers),
}


@pytest.mark.parametrize("name", sorted(LOUD))
def test_decode_sum_overflow_is_an_inf_not_a_finite_mean(name):
    """Documented limit of the paths that sum decoded payloads (the codec's ``psum`` or
    ``decode_sum``): where the float32 sum overflows the mean is inf; exact elsewhere."""
    codec, path, data = LOUD[name]
    fn = _reducer(codec, path, 8)
    g = np.asarray(data(8) * 5e37, np.float32)
    mean = np.asarray(fn(g)[0])
    want = g.astype(np.float64).mean(0)
    overflowed = np.abs(g.astype(np.float64).sum(0)) > np.finfo(np.float32).max
    assert overflowed.any() and np.isinf(mean[overflowed]).all()
    np.testing.assert_allclose(mean[~overflowed], want[~overflowed], rtol=1e-6)
