"""A codec written here, with its own multi-worker protocol, through compressed_mean and accordion.

The codec is signSGD with majority vote (Bernstein et al., 2019): each worker sends the signs of
its gradient as ``int8`` and one scale; the protocol sums the votes with one ``psum`` and
returns ``sign(votes) * mean scale``. Nothing in jaxcomp knows it: ``comm`` runs the protocol it
is handed and error feedback wraps it like any other.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms

pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((6,))}


def majority_sign() -> compressors.Codec:
    """signSGD with majority vote: ``int8`` signs and a ``float32`` scale per worker."""

    def compress(x, state, key=None):
        return (jnp.sign(x).astype(jnp.int8), jnp.mean(jnp.abs(x))), state

    def decompress(payload, like):
        signs, scale = payload
        return (signs.astype(jnp.float32) * scale).astype(like.dtype)

    def all_reduce(x, state, key, axis_name):
        payload, state = compress(x, state)
        signs, scale = payload
        if axis_name is not None:
            signs, scale = lax.psum(signs, axis_name), lax.pmean(scale, axis_name)
        mean = (jnp.sign(signs).astype(jnp.float32) * scale).astype(x.dtype)
        return mean, decompress(payload, x), state

    protocol = compressors.ReduceProtocol(
        init=lambda like, num_workers=None: compressors.EmptyState(),
        all_reduce=all_reduce,
        wire_bytes=lambda like, num_workers: math.prod(like.shape) + 4,
        name="majority_sign/vote",
    )
    codec = compressors.Codec(
        lambda x: compressors.EmptyState(), compress, decompress, "majority_sign"
    )
    return codec._replace(protocol=protocol)


def numpy_majority(steps, ef: bool):
    """The method by hand: per step the mean, and the workers' residuals."""
    e = np.zeros_like(steps[0])
    means = []
    for g in steps:
        c = g + e if ef else g
        scales = np.abs(c).reshape(W, -1).mean(1)
        means.append(np.sign(np.sign(c).sum(0)) * scales.mean())
        if ef:
            e = c - np.sign(c) * scales[:, None, None]
    return means


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def run_steps(tx, mesh, steps):
    state = tx.init(PARAMS)
    specs = comm.state_specs(state, comm.DATA)

    def body(state, g):
        updates, state = tx.update(jax.tree.map(lambda x: x[0], g), state)
        return updates, state

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=(P(), specs))
    )
    state = comm.place_state(state, mesh, comm.DATA)
    outs = []
    for w in steps:
        g = {"w": w, "b": np.ones((W, 6), np.float32)}
        updates, state = step(state, jax.device_put(g, NamedSharding(mesh, P(comm.DATA))))
        outs.append(updates)
    return outs, state, step


def worker_steps(n):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((W, 8, 6)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error_feedback"])
def test_compressed_mean_runs_the_users_protocol(mesh, ef):
    codec = majority_sign()
    steps = worker_steps(3)
    channel = feedback.error_feedback(codec) if ef else codec
    outs, state, step = run_steps(transforms.compressed_mean(channel), mesh, steps)
    for out, want in zip(outs, numpy_majority(steps, ef)):
        np.testing.assert_allclose(np.asarray(out["w"]), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(outs[-1]["b"]), 1.0)  # 1-D: dense mean
    assert comm.plan_reduce(channel, PARAMS["w"]).name.endswith("majority_sign/vote")
    # the votes travel as int8, as the protocol declares: 8 * 6 signs and a 4-byte scale
    grads = jax.device_put(
        {"w": steps[0], "b": np.ones((W, 6), np.float32)}, NamedSharding(mesh, P(comm.DATA))
    )
    report = comm.measure_collectives(step, state, grads)
    assert "s8" in report.dtypes("all-reduce")
    assert report.total_bytes == float(state.bytes_sent) == 8 * 6 + 4 + 6 * 4  # + dense bias


def test_accordion_runs_the_users_protocol_in_its_low_mode(mesh):
    steps = worker_steps(3)
    tx = transforms.accordion(majority_sign(), compressors.top_k(0.25), interval_steps=100)
    outs, state, _ = run_steps(tx, mesh, steps)
    assert int(transforms.accordion_metrics(state)["modes"]["w"]) == transforms.LOW_COMPRESSION
    for out, want in zip(outs, numpy_majority(steps, ef=True)):  # error feedback by default
        np.testing.assert_allclose(np.asarray(out["w"]), want, rtol=1e-6)
    # the same memory serves the high mode after a switch: one residual, as the reference
    residual = state.leaves["w"].memory.residual.value
    assert residual.shape == (W, 8, 6)


def test_optax_chain_with_the_users_codec_trains(mesh):
    """A full data-parallel step: the user's codec inside optax.chain with momentum."""

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    tx = optax.chain(
        transforms.compressed_mean(feedback.error_feedback(majority_sign())),
        optax.sgd(0.05, momentum=0.9),
    )
    dp = parallel.data_parallel(loss_fn, tx, mesh)
    rng = np.random.default_rng(1)
    batch = (rng.standard_normal((32, 8)).astype(np.float32),
             rng.standard_normal((32, 6)).astype(np.float32))  # fmt: skip
    state = dp.init(PARAMS)
    losses = []
    for _ in range(10):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
