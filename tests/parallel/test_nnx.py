"""Flax NNX models through local gradients, compressed_mean, data_parallel and AB-Training: the
same weights as a Linen model give the same gradients, updates and losses."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms

#: the Linen and NNX programs compare with each other, each compiled the same way
pytestmark = pytest.mark.usefixtures("fast_compiles")


def assert_close(got, want):
    """Linen's Dense and NNX's Linear lower their dot and bias slightly differently: the
    gradients differ in the last bit or two (3.7e-8 of 0.017 seen), and the steps after."""
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), got, want)


W = 4
BATCH = (
    np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32),
    np.random.default_rng(3).standard_normal((16, 4)).astype(np.float32),
)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fc2")(jnp.tanh(nn.Dense(16, name="fc1")(x)))


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


@functools.cache
def params():
    """The Linen model's initial parameters (built by the first test that asks, not at
    collection: every xdist worker collects every module)."""
    return LinenMLP().init(jax.random.key(0), BATCH[0])["params"]


def nnx_model():
    """An NNX model holding the Linen model's weights."""
    model = NNXMLP(nnx.Rngs(1))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.array, params()))
    nnx.update(model, state)
    return model


def linen_loss(params, batch):
    x, y = batch
    return jnp.mean((LinenMLP().apply({"params": params}, x) - y) ** 2)


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def powersgd_ef():
    return transforms.compressed_mean(feedback.error_feedback(compressors.power_sgd(2)))


def test_local_gradients_of_a_module_equal_linen_and_pass_compressed_mean(mesh):
    tx = powersgd_ef()
    state = comm.place_state(tx.init(params()), mesh, comm.DATA)
    specs = comm.state_specs(state, comm.DATA)
    batch = jax.device_put(BATCH, NamedSharding(mesh, P(comm.DATA)))

    def linen(state, batch):
        loss, grads = comm.local_value_and_grad(linen_loss, comm.DATA)(params(), batch)
        mean, state = tx.update(grads, state, params())
        return jax.tree.map(lambda g: g[None], grads), mean, state

    def nnx_(model, state, batch):
        loss, grads = comm.local_value_and_grad(nnx_loss, comm.DATA)(model, batch)
        grads = nnx.to_pure_dict(grads)  # an nnx.State, as nnx.value_and_grad gives
        mean, state = tx.update(grads, state, params())
        return jax.tree.map(lambda g: g[None], grads), mean, state

    out_specs = (P(comm.DATA), P(), specs)
    run = jax.jit(jax.shard_map(linen, mesh=mesh, in_specs=(specs, P(comm.DATA)),
                                out_specs=out_specs))  # fmt: skip
    model = nnx_model()
    model_specs = jax.tree.map(lambda _: P(), model)
    run_nnx = jax.jit(jax.shard_map(nnx_, mesh=mesh, in_specs=(model_specs, specs, P(comm.DATA)),
                                    out_specs=out_specs))  # fmt: skip
    want, got = run(state, batch), run_nnx(model, state, batch)
    assert_close(got, want)
    grads = np.asarray(want[0]["fc1"]["kernel"])
    assert not np.allclose(grads[0], grads[1])  # per-worker gradients: no hidden all-reduce
    report = comm.measure_collectives(run_nnx, model, state, batch)
    assert report.total_bytes == comm.measure_collectives(run, state, batch).total_bytes


def test_data_parallel_from_a_module_equals_linen(mesh):
    tx = optax.chain(powersgd_ef(), optax.sgd(0.1, momentum=0.9))
    linen = parallel.data_parallel(linen_loss, tx, mesh, check_finite=True)
    nnx_dp = parallel.data_parallel(nnx_loss, tx, mesh, check_finite=True)
    model = nnx_model()
    a, b = linen.init(params()), nnx_dp.init(model)
    for _ in range(2):
        a, metrics_a = linen.step(a, BATCH)
        b, metrics_b = nnx_dp.step(b, BATCH)
        assert float(metrics_a["loss"]) == pytest.approx(float(metrics_b["loss"]), rel=1e-6)
        np.testing.assert_array_equal(metrics_b["finite"], 1)
    assert_close((b.params, b.opt_state), (a.params, a.opt_state))
    assert not np.array_equal(b.params["fc1"]["kernel"], params()["fc1"]["kernel"])
    trained = b.module()  # merged back: a module with the new weights
    assert isinstance(trained, NNXMLP)
    assert_close(trained(BATCH[0]), LinenMLP().apply({"params": a.params}, BATCH[0]))
    np.testing.assert_array_equal(model.fc1.kernel[...], params()["fc1"]["kernel"])  # untouched
    with pytest.raises(ValueError, match="not made from an NNX module"):
        a.module()
    with pytest.raises(ValueError, match="carries its own state"):
        nnx_dp.init(model, {"x": jnp.zeros(2)})


class NNXBatchNormMLP(nnx.Module):
    def __init__(self, rngs, axis_name=None):
        self.fc = nnx.Linear(8, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name=axis_name, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.fc(x))


def test_data_parallel_keeps_a_synchronised_module_state_and_refuses_a_per_worker_one(mesh):
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))
    dp = parallel.data_parallel(nnx_loss, tx, mesh)
    state, _ = dp.step(dp.init(NNXBatchNormMLP(nnx.Rngs(0), axis_name=comm.DATA)), BATCH)
    y = jnp.asarray(BATCH[0]) @ jnp.asarray(dp.init(NNXBatchNormMLP(nnx.Rngs(0))).params["fc"][
        "kernel"])  # fmt: skip
    mean = 0.01 * np.asarray(y.mean(0))  # the running mean after one step (momentum 0.99)
    np.testing.assert_allclose(state.model_state.state["bn"]["mean"], mean, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="differs per worker"):
        dp.step(dp.init(NNXBatchNormMLP(nnx.Rngs(0))), BATCH)


def test_ab_training_from_a_module_equals_linen():
    mesh = parallel.ab_mesh(2, jax.devices()[:W])
    config = transforms.ABConfig(1e-2, warmup_steps=1, sync_every=2, full_rank_steps=1)
    linen = parallel.ab_data_parallel(linen_loss, config, mesh, donate=False)
    nnx_dp = parallel.ab_data_parallel(nnx_loss, config, mesh, donate=False)
    a, b = linen.init(params()), nnx_dp.init(nnx_model())
    for _ in range(3):  # warm-up, re-factorisation, an AB step
        a, metrics_a = linen.step(a, BATCH)
        b, metrics_b = nnx_dp.step(b, BATCH)
        assert float(metrics_a["loss"]) == pytest.approx(float(metrics_b["loss"]), rel=1e-6)
    assert_close((b.params, b.opt_state), (a.params, a.opt_state))
    assert int(transforms.ab_metrics(b.opt_state, b.params)["phase"]) == transforms.ABPhase.AB
    trained = b.module(worker=0)
    assert_close(
        trained(BATCH[0]), LinenMLP().apply({"params": parallel.worker_entry(a.params)}, BATCH[0])
    )
