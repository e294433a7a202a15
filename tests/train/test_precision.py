"""The trainer's mixed-precision policy (``config.compute_dtype``): float32 parameters, 16-bit
compute and pipeline boundaries (their wire bytes halved), float16's
dynamic loss scale (an overflowing step skipped, the scale halved, then grown)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import models
from jaxcomp import train
from jaxcomp.study import _moves
from jaxcomp.train import _config
from jaxcomp.train import _precision
from jaxcomp.train import _trainer

pytestmark = pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")


def _first_batch(s):
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    return _trainer.place(batch, s.mode.batch_sharding)


def _key(s, i):
    return _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(i))), s.mesh)


def test_loss_scale_halves_on_a_non_finite_step_and_doubles_after_the_interval():
    scale = _precision.LossScale(jnp.float32(8.0), jnp.int32(_precision.GROWTH_INTERVAL - 2))
    scale = _precision.adjust(scale, jnp.bool_(True))
    assert (float(scale.scale), int(scale.good_steps)) == (8.0, _precision.GROWTH_INTERVAL - 1)
    scale = _precision.adjust(scale, jnp.bool_(True))
    assert (float(scale.scale), int(scale.good_steps)) == (16.0, 0)
    scale = _precision.adjust(scale, jnp.bool_(False))
    assert (float(scale.scale), int(scale.good_steps)) == (8.0, 0)
    floor = _precision.adjust(_precision.LossScale(jnp.float32(1.0), jnp.int32(3)), False)
    assert float(floor.scale) == 1.0


def test_compute_dtype_is_a_checked_key_that_leaves_float32_fingerprints_alone(make_config):
    with pytest.raises(ValueError, match="compute_dtype"):
        _config.with_defaults(make_config(compute_dtype="float64"))
    plain = _config.fingerprint(_config.with_defaults(make_config()))
    assert "compute_dtype" not in plain  # a workdir from before the key resumes
    bf16 = _config.fingerprint(_config.with_defaults(make_config(compute_dtype="bfloat16")))
    assert bf16["compute_dtype"] == "bfloat16"


def test_policy_computes_in_16_bits_and_differentiates_float32_parameters():
    model = models.mlp(hidden=(8,)).with_compute_dtype("float16")
    # jitted: eagerly, each op compiled a program of its own (64 compiles)
    variables = jax.jit(model.init)(jax.random.key(0))
    x = np.ones((2, 64), np.float32)
    y, _ = jax.jit(model.apply)(variables, x)
    assert y.dtype == jnp.float16
    params = [v["params"] for v in variables]
    loss = jax.jit(jax.grad(lambda p: model.apply([{"params": q} for q in p], x)[0].sum()))
    grads = loss(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    with pytest.raises(ValueError, match="compute dtype"):
        model.with_compute_dtype("int8")


def test_float16_dense_skips_an_overflowing_step_halves_the_scale_then_trains(make_config):
    s = train.setup(make_config(compute_dtype="float16"))
    state = s.mode.init(jax.random.key(0))
    assert float(state.loss_scale.scale) == _precision.INITIAL_SCALE
    before = jax.tree.map(np.asarray, state.params)
    batch = _first_batch(s)
    huge = _precision.LossScale(
        _trainer._replicated(np.asarray(2.0**40, np.float32), s.mesh),
        _trainer._replicated(np.asarray(0, np.int32), s.mesh),
    )
    # the step donates its state: a fresh one to overflow
    new, metrics = s.mode.train_step(
        s.mode.init(jax.random.key(0))._replace(loss_scale=huge), batch, _key(s, 0), 0
    )
    assert int(metrics["finite"]) == 0  # float16 activation-gradients overflowed
    assert float(new.loss_scale.scale) == 2.0**39
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.params), before)
    losses = []
    for step in range(3):
        state, metrics = s.mode.train_step(state, batch, _key(s, step), step)
        assert int(metrics["finite"]) == 1
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert int(state.loss_scale.good_steps) == 3
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_the_scale_rides_the_backward_pass_only():
    scale = jnp.float32(2.0**10)

    def loss(w):
        w = _precision.gradient_unscaled({"w": w}, scale)["w"]
        return _precision.gradient_scaled(jnp.sum(w.astype(jnp.float16) ** 2), scale)

    w = jnp.asarray([1e-3, 3.0], jnp.float32)
    value, grad = jax.value_and_grad(loss)(w)
    assert value.dtype == jnp.float16 and float(value) == float(jnp.sum(w.astype(jnp.float16) ** 2))
    # the float16 backward ran at 2**10 times the gradient, divided back in float32
    np.testing.assert_array_equal(grad, jax.grad(lambda w: jnp.sum(w.astype(jnp.float16) ** 2))(w))


@pytest.mark.parametrize("mode", ["data_parallel", pytest.param("ab", marks=pytest.mark.slow)])
def test_float16_data_parallel_and_ab_skip_an_overflow_on_every_worker_and_halve_the_scale(
    make_mode_config, mode
):
    # data_parallel with plain SGD: an update not divided by the scale (2**15) would blow the
    # loss up (AB's division: tests/ab/test_parallel.py, bit for bit)
    sgd = dict(optax_name="sgd", lr=0.1) if mode == "data_parallel" else {}
    config = make_mode_config(mode, compute_dtype="float16", **sgd)
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    assert float(state.loss_scale.scale) == _precision.INITIAL_SCALE
    before = [np.asarray(x) for x in jax.tree.leaves(state.inner.params)]
    batch = _first_batch(s)
    huge = jax.device_put(
        _precision.LossScale(np.float32(2.0**40), np.int32(0)), state.loss_scale.scale.sharding
    )
    new, metrics = s.mode.train_step(state._replace(loss_scale=huge), batch, _key(s, 0), 0)
    assert int(metrics["finite"]) == 0  # float16 activation-gradients overflowed
    assert int(new.loss_scale.good_steps) == 0
    assert {float(x.data) for x in new.loss_scale.scale.addressable_shards} == {2.0**39}
    for x, y in zip(jax.tree.leaves(new.inner.params), before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)  # every worker's copy kept
    losses = []
    for step in range(3):
        state, metrics = s.mode.train_step(state, batch, _key(s, step), step)
        assert int(metrics["finite"]) == 1
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and 1.5 < losses[0] < 3.0  # the loss is reported unscaled
    assert int(state.loss_scale.good_steps) == 3
    assert float(state.loss_scale.scale) == _precision.INITIAL_SCALE


@pytest.mark.slow  # a pipeline-mode setup
def test_bfloat16_pipeline_sends_16_bit_boundaries_and_keeps_float32_parameters(make_config):
    config = make_config(
        mode="pipeline",
        mesh=[("stage", 2)],
        model={"hidden": (16,)},
        batch_size=32,
        eval_batch_size=32,
        compute_dtype="bfloat16",
        pipeline={"num_microbatches": 2, "forward": "identity", "backward": "identity"},
    )
    s = train.setup(config)
    # 1 boundary x 2 directions x 32 rows x 16 features, 2 bytes each (float32: 4096)
    assert s.mode.extra["boundary_bytes_per_step"] == 2048
    # GPipe 2 x 2: one permute per tick and direction (4), counted times its pairs in the
    # HLO bytes, beside the loss's and metrics' all-reduces
    assert s.mode.extra["permutes_per_step"] == 4
    # each permute recorded for the cost model: 16 rows x 16 features x 2 bytes per send
    permutes = s.mode.extra["boundary_permutes"]
    assert sum(p["executions"] for p in permutes) == 4
    assert _moves.boundary_payloads(permutes, 2, 2) == [(512, 512)]
    assert 2048 < s.mode.extra["hlo_collective_bytes_per_step"] <= 2048 + 64
    state = s.mode.init(jax.random.key(0))
    batch = _first_batch(s)
    losses = []
    for step in range(3):
        state, metrics = s.mode.train_step(state, batch, _key(s, step), step)
        assert int(metrics["finite"]) == 1
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert {b.dtype for b in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
