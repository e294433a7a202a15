"""compressed_mean: reference equivalences (pmean, numpy PowerSGD), warm-up, HLO bytes, errors."""

import functools

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
from jaxcomp.compressors import _low_rank

#: identity == pmean and the two inject_hyperparams forms compare programs of this process;
#  PowerSGD == numpy to a tolerance; the HLO byte counts are the compiled program's collectives:
#  no bit of an optimised formula, so the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
PARAMS = {
    "conv": jnp.zeros((3, 3, 4, 6)),
    "bias": jnp.zeros((6,)),
    "dense": jnp.zeros((12, 8)),
}


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def worker_grads(seed, params=PARAMS, scale=1.0):
    """Per-worker gradients ``[W, *shape]`` for every parameter (numpy)."""
    rng = np.random.default_rng(seed)
    return {
        k: scale * rng.standard_normal((W, *v.shape)).astype(np.float32) for k, v in params.items()
    }


def sharded_update(tx, mesh, params=PARAMS):
    """Jitted ``(state, grads[W, ...]) -> (updates, state)`` running ``tx.update`` per worker."""
    state = tx.init(params)  # outside shard_map, as optax users call it
    specs = comm.state_specs(state, comm.DATA)

    def body(state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    update = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=(P(), specs))
    )

    def put(grads):
        return jax.device_put(grads, NamedSharding(mesh, P(comm.DATA)))

    return comm.place_state(state, mesh, comm.DATA), update, put


# ----------------------------------------------------------------------------------------------
# Reference equivalences


def test_identity_equals_pmean_exactly(mesh):
    grads = worker_grads(0)
    for rate in (2.0, 0.0):  # dense fallback, and the psum path of the identity codec
        tx = transforms.compressed_mean(
            compressors.identity(), min_compression_rate=rate, min_ndim=0
        )
        state, update, put = sharded_update(tx, mesh)
        means, _ = update(state, put(grads))
        pmean = jax.jit(
            jax.shard_map(
                lambda g: jax.tree.map(lambda x: lax.pmean(x[0], comm.DATA), g),
                mesh=mesh,
                in_specs=P(comm.DATA),
                out_specs=P(),
            )
        )(put(grads))
        for k in PARAMS:
            np.testing.assert_array_equal(np.asarray(means[k]), np.asarray(pmean[k]))


def numpy_orthogonalize(p, eps=1e-8):
    """Gram-Schmidt as in epfml/powersgd ``orthogonalize``."""
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.sqrt(np.sum(p[:, i] ** 2)) + eps
        if i + 1 < p.shape[1]:
            p[:, i + 1 :] -= np.sum(p[:, i : i + 1] * p[:, i + 1 :], axis=0) * p[:, i : i + 1]
    return p


def numpy_powersgd(steps, q0, shape):
    """Published PowerSGD with EF and warm start over ``len(steps)`` steps of ``[W, *shape]``."""
    rows, cols = _low_rank.matrix_shape(shape)
    e = np.zeros((W, rows, cols), np.float64)
    q = np.asarray(q0, np.float64)
    outs, memories, queries = [], [], []
    for g in steps:
        m = g.reshape(W, rows, cols).astype(np.float64) + e
        p = numpy_orthogonalize(sum(m[w] @ q for w in range(W)))
        q = sum(m[w].T @ p for w in range(W)) / W
        out = p @ q.T
        e = m - out[None]
        outs.append(out.reshape(shape))
        memories.append(e.reshape(W, *shape))
        queries.append(q)
    return outs, memories, queries


def test_power_sgd_matches_numpy_reference_over_steps(mesh):
    codec = compressors.power_sgd(2, seed=3)
    tx = transforms.compressed_mean(feedback.error_feedback(codec))
    state, update, put = sharded_update(tx, mesh)
    steps = [worker_grads(s) for s in range(4)]
    ours = []
    for g in steps:
        means, state = update(state, put(g))
        ours.append((means, state))
    for name in ("conv", "dense"):
        shape = PARAMS[name].shape
        q0 = codec.init(PARAMS[name]).q
        outs, memories, queries = numpy_powersgd([g[name] for g in steps], q0, shape)
        for (means, st), out, mem, q in zip(ours, outs, memories, queries):
            leaf = st.leaves[name]  # error feedback around PowerSGD's own protocol
            assert isinstance(leaf.inner, compressors.LowRankReduce)
            residual = leaf.memory.residual.value
            np.testing.assert_allclose(np.asarray(means[name]), out, rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(np.asarray(residual), mem, rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(np.asarray(leaf.inner.q.q), q, rtol=2e-4, atol=2e-5)
    # the 1-D bias is averaged exactly
    np.testing.assert_allclose(
        np.asarray(ours[-1][0]["bias"]), steps[-1]["bias"].mean(0), rtol=1e-6, atol=1e-7
    )


def test_power_sgd_without_feedback_has_no_memory(mesh):
    tx = transforms.compressed_mean(compressors.power_sgd(1))
    state, update, put = sharded_update(tx, mesh)
    assert isinstance(state.leaves["dense"], compressors.LowRankReduce)  # no feedback memory
    means, state = update(state, put(worker_grads(1)))
    rows, cols = _low_rank.matrix_shape(PARAMS["dense"].shape)
    assert np.linalg.matrix_rank(np.asarray(means["dense"]).reshape(rows, cols), tol=1e-4) == 1


def test_warmup_steps_are_dense_then_compressed(mesh):
    tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1)), warmup_steps=2)
    state, update, put = sharded_update(tx, mesh)
    for step in range(3):
        g = worker_grads(10 + step)
        means, state = update(state, put(g))
        exact = np.allclose(np.asarray(means["dense"]), g["dense"].mean(0), atol=1e-6)
        assert exact == (step < 2)
        residual = np.asarray(state.leaves["dense"].memory.residual.value)
        assert (np.abs(residual).max() > 0) == (step >= 2)  # warm-up leaves the residual alone
    dense = sum(v.size * 4 for v in PARAMS.values())
    assert float(state.bytes_sent) < dense / 2


def test_ef21_receiver_tracks_mean_of_sender_estimates(mesh):
    tx = transforms.compressed_mean(feedback.ef21(compressors.top_k(0.25)))
    state, update, put = sharded_update(tx, mesh)
    g = worker_grads(5)
    for _ in range(6):  # a fixed signal: EF21's estimates converge to it
        means, state = update(state, put(g))
    memory = state.leaves["dense"].memory  # receivers' estimate of the mean; senders' own
    np.testing.assert_allclose(
        np.asarray(memory.mean), np.asarray(memory.estimate.value).mean(0), atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(means["dense"]), np.asarray(memory.mean))
    err = np.linalg.norm(np.asarray(means["dense"]) - g["dense"].mean(0))
    assert err < 0.2 * np.linalg.norm(g["dense"].mean(0))


# ----------------------------------------------------------------------------------------------
# Composition and wire bytes of a full data-parallel step


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


MLP = {
    "w1": jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)) * 0.1, jnp.float32),
    "b1": jnp.zeros((32,)),
    "w2": jnp.asarray(np.random.default_rng(1).standard_normal((32, 8)) * 0.1, jnp.float32),
}
BATCH = (
    np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32),
    np.random.default_rng(3).standard_normal((32, 8)).astype(np.float32),
)


@pytest.mark.parametrize(
    "codec",
    [
        compressors.power_sgd(2),
        compressors.top_k(0.1),
        compressors.quantize(4),
        compressors.rand_k(0.1),
    ],
    ids=lambda c: c.name,
)
def test_hlo_of_dp_step_sends_only_payloads(mesh, codec):
    tx = optax.chain(
        transforms.compressed_mean(feedback.error_feedback(codec)), optax.sgd(0.1, momentum=0.9)
    )
    dp = parallel.data_parallel(mlp_loss, tx, mesh, donate=False)
    state = dp.init(MLP)
    report = comm.measure_collectives(dp.step, state, BATCH)
    for r in report.records:  # no uncompressed gradient all-reduce
        if r.kind == "all-reduce":
            assert not any(dims in r.shape for dims in ("[16,32]", "[32,8]")), r.shape
    new_state, _ = dp.step(state, BATCH)
    sent = float(new_state.opt_state[0].bytes_sent)
    assert report.total_bytes == sent + 4  # + the f32 loss pmean
    assert sent < (16 * 32 + 32 * 8) * 4 / 2


def test_composes_with_adamw_and_keeps_state_types(mesh):
    tx = optax.chain(
        transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.25))),
        optax.adamw(1e-2, weight_decay=1e-4),
    )
    dp = parallel.data_parallel(mlp_loss, tx, mesh, donate=False)
    state = dp.init(MLP)
    losses = []
    for _ in range(8):
        new_state, metrics = dp.step(state, BATCH)
        assert jax.tree.map(jax.typeof, new_state) == jax.tree.map(jax.typeof, state)
        state = new_state
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------------------------
# Bad input


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="Codec or Channel"):
        transforms.compressed_mean(optax.sgd(0.1))
    with pytest.raises(ValueError, match="path must be one of"):
        transforms.compressed_mean(compressors.top_k(0.1), path="ring")
    with pytest.raises(ValueError, match="psum"):
        transforms.compressed_mean(compressors.top_k(0.1), path="psum")
    with pytest.raises(ValueError, match="low_rank"):
        transforms.compressed_mean(compressors.quantize(8), path="low_rank")
    with pytest.raises(ValueError, match="per-sample"):
        transforms.compressed_mean(feedback.aq_sgd(compressors.quantize(4), num_samples=10))
    with pytest.raises(ValueError, match="min_compression_rate"):
        transforms.compressed_mean(compressors.top_k(0.1), min_compression_rate=-1)
    with pytest.raises(ValueError, match="axis_name"):
        transforms.compressed_mean(compressors.top_k(0.1), axis_name=3)
    with pytest.raises(ValueError, match="seed must be an integer"):
        transforms.compressed_mean(compressors.top_k(0.1), seed=1.5)
    with pytest.raises(ValueError, match="warmup_steps must be an integer"):
        transforms.compressed_mean(compressors.top_k(0.1), warmup_steps=-1)


def test_wrong_axis_name_raises(mesh):
    tx = transforms.compressed_mean(compressors.top_k(0.1), axis_name="batch")
    state = tx.init(PARAMS)  # init needs no mesh; the update names the missing axis
    with pytest.raises(ValueError, match="axis_name 'batch' is not a mesh axis"):
        jax.eval_shape(
            jax.shard_map(lambda g: tx.update(g, state)[0], mesh=mesh, in_specs=P(), out_specs=P()),
            PARAMS,
        )
    with pytest.raises(ValueError, match="not inside shard_map"):
        transforms.compressed_mean(compressors.top_k(0.1)).update(PARAMS, state)


def test_mismatched_trees_raise(mesh):
    tx = transforms.compressed_mean(compressors.top_k(0.1))
    state, update, put = sharded_update(tx, mesh)
    other = {"dense": PARAMS["dense"], "bias": PARAMS["bias"]}
    body = functools.partial(tx.update, state=state)
    with pytest.raises(ValueError, match="does not match"):
        jax.eval_shape(
            jax.shard_map(lambda g: body(g)[0], mesh=mesh, in_specs=P(), out_specs=P()), other
        )


def test_unhandled_shape_falls_back_to_dense_with_a_logged_reason(mesh, caplog):
    codec = compressors.quantize(8, scale="feature", axes=(5,))  # no axis 5 in 2-D/4-D arrays
    tx = transforms.compressed_mean(codec, min_ndim=0)
    with caplog.at_level("INFO", logger="jaxcomp.comm._reduce_plan"):
        state, update, put = sharded_update(tx, mesh)
    assert all(isinstance(s, comm.DenseReduce) for s in state.leaves.values())
    assert "cannot compress" in caplog.text and "['dense']" in caplog.text
    g = worker_grads(7)
    means, _ = update(state, put(g))
    np.testing.assert_allclose(np.asarray(means["conv"]), g["conv"].mean(0), rtol=1e-6)


def test_static_option_under_inject_hyperparams_gets_a_clear_error():
    tx = optax.inject_hyperparams(transforms.compressed_mean)(compressors.top_k(0.1))
    with pytest.raises(ValueError, match="static_args"):
        jax.eval_shape(tx.init, PARAMS)


def test_inject_hyperparams_with_static_args_equals_the_plain_transform(mesh):
    codec = feedback.error_feedback(compressors.top_k(0.25))
    injected = optax.inject_hyperparams(
        transforms.compressed_mean,
        static_args=("min_compression_rate", "min_ndim", "warmup_steps", "seed"),
    )(codec, warmup_steps=1)
    plain = transforms.compressed_mean(codec, warmup_steps=1)
    g = [worker_grads(20 + i) for i in range(2)]
    results = []
    for tx in (injected, plain):
        state, update, put = sharded_update(tx, mesh)
        for grads in g:
            means, state = update(state, put(grads))
        results.append(means)
    for k in PARAMS:
        np.testing.assert_array_equal(np.asarray(results[0][k]), np.asarray(results[1][k]))
