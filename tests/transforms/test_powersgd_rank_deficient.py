"""Data-parallel PowerSGD on rank-deficient gradients (issue 9 item 1), through the public API.

4 workers each hold a rank-1 gradient; at rank 4 the mean (rank <= 4) must be exact, and a
rank-1 mean of identical rank-1 gradients too. The one-pass Gram-Schmidt with an absolute
epsilon normalised rounding noise into non-orthogonal columns and got these wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import transforms
from jaxcomp.compressors import _low_rank

pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
# large enough that rank 4 compresses them (no dense fallback): 6.9x and 3.3x
PARAMS = {"dense": jnp.zeros((64, 48)), "conv": jnp.zeros((3, 3, 8, 16))}


@pytest.fixture(scope="module")
def mean_step():
    """Jitted ``grads[W, ...] -> (mean, state)`` of ``compressed_mean(power_sgd(4))``, stepping
    its state (warm start) across calls."""
    mesh = comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])
    tx = transforms.compressed_mean(compressors.power_sgd(4))
    state = tx.init(PARAMS)
    specs = comm.state_specs(state, comm.DATA)

    def body(state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    update = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=(P(), specs))
    )
    state = [comm.place_state(state, mesh, comm.DATA)]

    def step(grads):
        grads = jax.device_put(grads, NamedSharding(mesh, P(comm.DATA)))
        means, state[0] = update(state[0], grads)
        return means

    return step


def rank1_grads(seed, scale=1.0, same=False):
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in PARAMS.items():
        rows, cols = _low_rank.matrix_shape(p.shape)
        u = rng.standard_normal((1 if same else W, rows, 1))
        v = rng.standard_normal((1 if same else W, 1, cols))
        g = np.broadcast_to(u @ v, (W, rows, cols)) * scale
        out[name] = np.asarray(g.reshape(W, *p.shape), np.float32)
    return out


@pytest.mark.parametrize("magnitude", [1e-10, 1.0, 1e6], ids=lambda m: f"{m:g}")
def test_mean_of_rank1_gradients_is_exact(mean_step, magnitude):
    for step in range(3):  # over several steps of the warm start
        for same in (False, True):  # rank-4 mean; identical gradients: rank-1 mean
            grads = rank1_grads(10 * step + same, magnitude, same)
            means = mean_step(grads)
            for name, g in grads.items():
                want = g.astype(np.float64).mean(0)
                np.testing.assert_allclose(
                    np.asarray(means[name]), want, rtol=0, atol=1e-5 * np.abs(want).max()
                )


def test_full_rank_gradients_are_really_compressed(mean_step):
    """The exactness above is PowerSGD's, not a dense fallback's."""
    rng = np.random.default_rng(5)
    grads = {k: rng.standard_normal((W, *p.shape)).astype(np.float32) for k, p in PARAMS.items()}
    means = mean_step(grads)
    for name, g in grads.items():
        want = g.mean(0)
        err = np.linalg.norm(np.asarray(means[name]) - want) / np.linalg.norm(want)
        assert err > 0.3, name


def test_all_zero_gradients_give_zero_and_recover(mean_step):
    zeros = {k: np.zeros((W, *p.shape), np.float32) for k, p in PARAMS.items()}
    means = mean_step(zeros)
    for name in PARAMS:
        np.testing.assert_array_equal(np.asarray(means[name]), 0.0)
    grads = rank1_grads(99)
    means = mean_step(grads)
    for name, g in grads.items():
        want = g.astype(np.float64).mean(0)
        np.testing.assert_allclose(np.asarray(means[name]), want, atol=1e-5 * np.abs(want).max())
