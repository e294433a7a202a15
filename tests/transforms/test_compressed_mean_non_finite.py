"""compressed_mean with a NaN in one worker's gradient: never a finite mean made from it.

The mean of the parameter that holds the NaN is non-finite on every worker (other parameters
are unaffected); without error feedback the next clean step is clean, with it the memory keeps
the NaN (every later mean non-finite: a finiteness guard such as ``train.commit_if_finite``
must skip the step). Holds the behaviour observed 2026-12-02 (no fix was needed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import transforms

pytestmark = pytest.mark.usefixtures("fast_compiles")  # non-finiteness only: no bits

W = 4
PARAMS = {"hit": jnp.zeros((16, 8)), "other": jnp.zeros((16, 8))}
CODECS = {
    "top_k": (compressors.top_k(0.25), False),
    "quantize": (compressors.quantize(4), False),
    "ef_power_sgd": (feedback.error_feedback(compressors.power_sgd(1)), True),
}


@pytest.mark.parametrize("name", list(CODECS))
def test_a_nan_gradient_is_never_averaged_into_a_finite_mean(name):
    codec, keeps = CODECS[name]
    mesh = comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])
    tx = transforms.compressed_mean(codec, min_compression_rate=0)
    state = tx.init(PARAMS)
    specs = (comm.state_specs(state, comm.DATA), P(comm.DATA))  # (state, per-worker grads)
    local = lambda s, g: tx.update(jax.tree.map(lambda x: x[0], g), s)  # noqa: E731
    update = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), specs[0])))
    rng = np.random.default_rng(0)
    clean = {k: rng.standard_normal((W, *v.shape)).astype(np.float32) for k, v in PARAMS.items()}
    bad = {k: v.copy() for k, v in clean.items()}
    bad["hit"][1, 3, 2] = np.nan  # worker 1 only
    put = lambda g: jax.device_put(g, NamedSharding(mesh, P(comm.DATA)))  # noqa: E731
    state = comm.place_state(state, mesh, comm.DATA)
    poisoned, state = update(state, put(bad))
    assert not np.all(np.isfinite(np.asarray(poisoned["hit"])))
    assert np.all(np.isfinite(np.asarray(poisoned["other"])))
    after, _ = update(state, put(clean))
    assert np.all(np.isfinite(np.asarray(after["other"])))
    assert bool(np.all(np.isfinite(np.asarray(after["hit"])))) is not keeps
