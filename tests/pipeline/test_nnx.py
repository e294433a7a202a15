"""Pipeline stages from Flax NNX modules (equal to the same weights in Linen stages, BatchNorm
statistics as stage state), and an optimizer that sees the packed parameters by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import pipeline

pytestmark = pytest.mark.usefixtures("fast_compiles")

S, M, WIDTH = 2, 4, 8
RNG = np.random.default_rng(0)
BATCH = {
    "x": jnp.asarray(RNG.standard_normal((16, WIDTH)), jnp.float32),
    "label": jnp.asarray(RNG.standard_normal((16, WIDTH)), jnp.float32),
}


def mse(y, labels):
    return jnp.mean((y - labels) ** 2)


class LinenStage(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(WIDTH, name="fc")(x))


class NNXStage(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.fc(x))


class NNXNormStage(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.bn(self.fc(x)))


def linen_stage_fn(p, x):
    return LinenStage().apply({"params": p}, x)


#: Linen's Dense parameters from numpy (``LinenStage().init`` at import compiled ~0.5 s of
#: eager ops in every process that collects this module)
STAGE_PARAMS = [
    {"fc": {
        "kernel": jnp.asarray(RNG.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
        "bias": jnp.zeros((WIDTH,), jnp.float32),
    }}
    for _ in range(S)
]  # fmt: skip


def with_weights(module, params):
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.array, params))
    nnx.update(module, state)
    return module


@pytest.fixture(scope="module")
def mesh():
    return pipeline.pipeline_mesh(S, jax.devices()[:S])


def test_nnx_stages_give_the_losses_and_gradients_of_the_same_linen_stages(mesh):
    link = pipeline.link(feedback.error_feedback(compressors.top_k(0.5)), compressors.quantize(8))
    config = pipeline.PipelineConfig(M, link, schedule="1f1b")
    modules = [with_weights(NNXStage(nnx.Rngs(9)), p) for p in STAGE_PARAMS]
    stages = pipeline.nnx_stages(modules, mse)
    assert stages.model_state is None
    jax.tree.map(np.testing.assert_array_equal, stages.params, tuple(STAGE_PARAMS))
    sharding = NamedSharding(mesh, P("stage"))
    results = []
    for model, params in (
        (pipeline.StagedModel((linen_stage_fn,) * S, mse), STAGE_PARAMS),
        (stages.model, stages.params),
    ):
        pipe = pipeline.distribute(model, config, mesh)
        packed = pipeline.pack_params(params, sharding)
        states = pipe.init(packed, BATCH)
        step = jax.jit(pipe.step)
        for t in range(2):
            loss, grads, states, _ = step(packed, BATCH, states, jax.random.key(t))
        results.append((loss, grads.unpack()))
    # Linen's Dense and NNX's Linear lower dot and bias slightly differently (last bits)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), *results[::-1]
    )
    trained = stages.modules(results[1][1])  # merged back into modules
    np.testing.assert_array_equal(trained[0].fc.kernel[...], results[1][1][0]["fc"]["kernel"])


def test_nnx_batch_norm_stage_keeps_its_statistics_as_pipeline_state():
    modules = [NNXNormStage(nnx.Rngs(s)) for s in range(S)]
    stages = pipeline.nnx_stages(modules, mse)
    assert stages.model.stateful and sorted(stages.model_state[0]["bn"]) == ["mean", "var"]
    pipe = pipeline.simulate(stages.model, pipeline.PipelineConfig(M, pipeline.link()))
    packed = pipeline.pack_params(stages.params)
    states = pipe.init(packed, BATCH, stages.model_state)
    loss, _, states, _ = jax.jit(pipe.step)(packed, BATCH, states, jax.random.key(0))
    # the reference: the modules in training mode, microbatch after microbatch
    want, losses = [m for m in modules], []
    for x, y in zip(np.split(BATCH["x"], M), np.split(BATCH["label"], M)):
        for m in want:
            x = m(x)
        losses.append(mse(x, y))
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-6)
    for s in range(S):
        np.testing.assert_allclose(
            states.model_state(s)["bn"]["mean"], want[s].bn.mean[...], rtol=1e-6, atol=1e-7
        )
    evaluated = stages.modules(packed, [states.model_state(s) for s in range(S)])
    evaluated[0].eval()
    np.testing.assert_allclose(evaluated[0].bn.var[...], want[0].bn.var[...], rtol=1e-6)


def kernels_only(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


NAMED = optax.chain(
    optax.masked(optax.add_decayed_weights(0.5), kernels_only),
    optax.scale_by_trust_ratio(),  # LARS: one ratio per leaf
    optax.sgd(0.1, momentum=0.9),
)
#: the references' NAMED, jitted once for both cases (op by op: ~50 compiles per case)
NAMED_INIT, NAMED_UPDATE = jax.jit(NAMED.init), jax.jit(NAMED.update)


@pytest.mark.parametrize("sharded", [True, False], ids=["distributed", "simulated"])
def test_unpacked_optimizer_sees_names_as_on_the_unpipelined_model(mesh, sharded):
    tx = pipeline.unpacked(NAMED, mesh if sharded else None)
    sharding = NamedSharding(mesh, P("stage")) if sharded else None
    params = pipeline.pack_params(STAGE_PARAMS, sharding)
    grads = pipeline.pack_params(
        [jax.tree.map(lambda x: jnp.cos(3 * x) + 0.1, p) for p in STAGE_PARAMS], sharding
    )
    reference_state = NAMED_INIT(tuple(STAGE_PARAMS))
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    want_params = tuple(STAGE_PARAMS)
    for _ in range(2):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        want, reference_state = NAMED_UPDATE(grads.unpack(), reference_state, want_params)
        want_params = optax.apply_updates(want_params, want)
        for got, ref in zip(updates.unpack(), want):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, ref)
    if sharded:
        assert state.buffers["float32"].sharding.spec == P("stage")
    else:  # the same chain on the packed buffers sees no names (and one trust ratio a buffer)
        first = pipeline.pack_params(STAGE_PARAMS)
        packed, _ = NAMED_UPDATE(grads, NAMED_INIT(first), first)
        reference, _ = NAMED_UPDATE(grads.unpack(), NAMED_INIT(tuple(STAGE_PARAMS)),
                                    tuple(STAGE_PARAMS))  # fmt: skip
        assert not np.allclose(packed.unpack()[0]["fc"]["kernel"], reference[0]["fc"]["kernel"])


def test_unpacked_refuses_a_transformation_across_stages():
    params = pipeline.pack_params(STAGE_PARAMS)
    with pytest.raises(ValueError, match="clip_by_global_norm"):
        pipeline.unpacked(optax.chain(optax.clip_by_global_norm(1.0), NAMED)).init(params)
    with pytest.raises(ValueError, match="PackedParams"):
        pipeline.unpacked(NAMED).init(STAGE_PARAMS)
