"""data_parallel: equals full-batch training, hides no all-reduce, shards per-worker state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms

#: identity == full-batch training to rtol 1e-5, the collectives' shapes and dtypes, sharding
#  specs, finite flags: no bit of an optimised formula, so the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
PARAMS = {
    "w1": jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)) * 0.1, jnp.float32),
    "b1": jnp.zeros((32,)),
    "w2": jnp.asarray(np.random.default_rng(1).standard_normal((32, 8)) * 0.1, jnp.float32),
}
BATCH = (
    np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32),
    np.random.default_rng(3).standard_normal((32, 8)).astype(np.float32),
)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


REFERENCE = optax.sgd(0.1, 0.9)


@jax.jit  # one program (run eagerly, the reference compiled one per op and shape)
def full_batch_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = REFERENCE.update(grads, opt_state)
    return loss, optax.apply_updates(params, updates), opt_state


def test_identity_compression_equals_full_batch_training(mesh):
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1, 0.9))
    dp = parallel.data_parallel(loss_fn, tx, mesh)
    state = dp.init(PARAMS)
    params, opt_state = PARAMS, REFERENCE.init(PARAMS)
    for _ in range(3):
        state, metrics = dp.step(state, BATCH)
        loss, params, opt_state = full_batch_step(params, opt_state, BATCH)
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    for k in PARAMS:
        np.testing.assert_allclose(state.params[k], params[k], rtol=1e-5, atol=1e-6)
    assert int(state.step) == 3
    # the step reports each worker's bytes sent and the dense gradient's: identity sends it all
    dense = 4.0 * sum(x.size for x in PARAMS.values())
    assert metrics["dense_bytes"].tolist() == [dense] * W
    assert metrics["bytes_sent"].tolist() == [float(state.opt_state[0].bytes_sent)] * W
    assert metrics["bytes_sent"].tolist() == [dense] * W


def test_no_hidden_all_reduce_unlike_plain_grad(mesh):
    tx = optax.chain(transforms.compressed_mean(compressors.top_k(0.1)), optax.sgd(0.1))
    dp = parallel.data_parallel(loss_fn, tx, mesh, donate=False)
    state = dp.init(PARAMS)
    ours = comm.measure_collectives(dp.step, state, BATCH)

    def naive(params, batch):  # jax.grad of replicated params: XLA all-reduces the gradient
        return jax.tree.map(lambda g: lax.pmean(g, comm.DATA), jax.grad(loss_fn)(params, batch))

    naive_step = jax.jit(
        jax.shard_map(naive, mesh=mesh, in_specs=(P(), P(comm.DATA)), out_specs=P())
    )
    theirs = comm.measure_collectives(naive_step, PARAMS, dp.shard_batch(BATCH))
    assert any("f32[16,32]" in r.shape for r in theirs.records if r.kind == "all-reduce")
    assert not any("f32[16,32]" in r.shape for r in ours.records if r.kind == "all-reduce")
    assert ours.dtypes("all-gather") == {"f32", "u16", "u8"}  # TopK values and indices


def test_per_worker_state_is_sharded_and_the_rest_replicated(mesh):
    tx = optax.chain(
        transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1))),
        optax.sgd(0.1, momentum=0.9),
    )
    specs = comm.state_specs(tx.init(PARAMS), comm.DATA)
    cm_state, sgd_state = specs
    assert cm_state.leaves["w1"].memory.residual.value == P(comm.DATA)
    assert cm_state.count == P() and cm_state.leaves["b1"] == comm.DenseReduce()
    assert all(s == P() for s in jax.tree.leaves(sgd_state))
    state = parallel.data_parallel(loss_fn, tx, mesh).init(PARAMS)
    residual = state.opt_state[0].leaves["w1"].memory.residual.value
    assert residual.shape == (W, 16, 32) and residual.sharding.spec == P(comm.DATA)


def test_aux_metrics_are_averaged(mesh):
    def with_aux(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"twice": 2 * loss}

    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))
    dp = parallel.data_parallel(with_aux, tx, mesh, has_aux=True)
    _, metrics = dp.step(dp.init(PARAMS), BATCH)
    assert float(metrics["aux"]["twice"]) == pytest.approx(2 * float(metrics["loss"]), rel=1e-6)


def test_errors_name_the_problem(mesh):
    dp = parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    with pytest.raises(ValueError, match="must average gradients"):
        dp.step(dp.init(PARAMS), BATCH)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        parallel.data_parallel(loss_fn, optax.sgd(0.1), mesh, axis_name="batch")
    good = parallel.data_parallel(
        loss_fn, optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1)),
        mesh,
    )  # fmt: skip
    state = good.init(PARAMS)
    with pytest.raises(ValueError, match="live on the mesh"):
        good.step(jax.tree.map(np.asarray, state), BATCH)
    odd = (BATCH[0][:30], BATCH[1][:30])
    with pytest.raises(ValueError, match=r"\[0\] has 30 rows .*not divisible by the 4 workers"):
        good.step(state, odd)

    def scalar_state():  # a transform with a per-worker scalar in its state
        def init(params):
            return compressors.PerWorker(jnp.zeros(()))

        return optax.GradientTransformation(init, lambda u, s, p=None: (u, s))

    with pytest.raises(ValueError, match="leading worker axis"):
        comm.place_state(scalar_state().init(PARAMS), mesh, comm.DATA)


def test_check_finite_flags_each_worker_without_a_collective(mesh):
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))
    plain = parallel.data_parallel(loss_fn, tx, mesh, donate=False)
    dp = parallel.data_parallel(loss_fn, tx, mesh, donate=False, check_finite=True)
    state = dp.init(PARAMS)
    new, metrics = dp.step(state, BATCH)
    assert metrics["finite"].shape == (W,) and np.asarray(metrics["finite"]).tolist() == [1] * W
    assert "finite" not in plain.step(plain.init(PARAMS), BATCH)[1]
    # a NaN in worker 2's shard: its flag drops; the others' fall too once the NaN is averaged
    # into the replicated parameters (their own new state is not finite)
    x, y = BATCH[0].copy(), BATCH[1]
    x[2 * len(x) // W] = np.nan
    _, bad = dp.step(state, (x, y))
    assert np.asarray(bad["finite"]).tolist() == [0] * W and np.isnan(float(bad["loss"]))
    # the flags add no collective
    ours = comm.measure_collectives(dp.step, state, BATCH)
    base = comm.measure_collectives(plain.step, plain.init(PARAMS), BATCH)
    assert sorted(r.shape for r in ours.records) == sorted(r.shape for r in base.records)


def test_only_a_worker_whose_own_state_is_not_finite_is_flagged(mesh):
    # a per-worker model state (as BatchNorm statistics per worker) that only worker 1's
    # shard makes infinite; the averaged gradient and the parameters stay finite
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))

    def stateful(params, model_state, batch):
        x, s = batch
        new = compressors.PerWorker({"m": model_state.value["m"] + s.sum()})
        return loss_fn(params, (x, BATCH[1][: len(x)])), new

    dp = parallel.data_parallel(stateful, tx, mesh, has_state=True, donate=False,
                                check_finite=True)  # fmt: skip
    s = np.zeros((len(BATCH[0]),), np.float32)
    s[len(s) // W] = np.inf  # the first row of worker 1's shard
    state = dp.init(PARAMS, compressors.PerWorker({"m": jnp.zeros((1,))}))
    new, metrics = dp.step(state, (BATCH[0], s))
    assert np.asarray(metrics["finite"]).tolist() == [1, 0, 1, 1]
    assert np.isfinite(float(metrics["loss"]))
    assert np.asarray(new.model_state.value["m"]).tolist() == [0, np.inf, 0, 0]


def test_a_python_scalar_parameter_runs_two_steps(mesh):
    # a weakly typed leaf: the step's compile cache keys on weak types too
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))
    dp = parallel.data_parallel(lambda p, b: loss_fn(p, b) + p["s"] ** 2, tx, mesh)
    state = dp.init({**PARAMS, "s": 1.0})
    for _ in range(2):
        state, _ = dp.step(state, BATCH)
    assert float(state.params["s"]) == pytest.approx(1.0 * 0.8**2, rel=1e-5)
