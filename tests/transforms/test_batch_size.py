"""accordion_batch_size: the detector picks the accumulation length; MultiSteps equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms

pytestmark = pytest.mark.usefixtures("fast_compiles")

PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
DIRECTION = {
    "w": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
    "b": np.random.default_rng(1).standard_normal((3,)).astype(np.float32),
}


def grads_of(scale):
    return {k: jnp.asarray(scale * d) for k, d in DIRECTION.items()}


def test_detector_sets_the_batch_and_updates_use_the_linear_lr_rule():
    steps, small, large = 4, 1, 2
    scales = [1.0, 1.0, 1.1, 3.0, 3.1, 3.0]  # per interval: calm, calm, change, calm, calm
    tx = transforms.accordion_batch_size(
        optax.sgd(1.0),
        interval_steps=steps,
        small_steps=small,
        large_steps=large,
        check_every=1,
        axis_name=None,
    )
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    expected_k, prev = small, None
    pending = []
    for interval, scale in enumerate(scales):
        for _ in range(steps):
            assert int(transforms.batch_size_metrics(state)["every_k"]) == expected_k
            updates, state = update(grads_of(scale), state)
            pending.append(scale)
            if len(pending) == expected_k:  # an update: minus the mean, times k / small
                want = -np.mean(pending) * expected_k / small
                np.testing.assert_allclose(updates["w"], want * DIRECTION["w"], rtol=1e-5)
                pending = []
            else:
                assert not np.any(np.asarray(updates["w"]))
        norm = steps * scale
        critical = interval == 0 or abs(prev - norm) / prev >= 0.5
        expected_k, prev = (small if critical else large), norm
    assert int(state.every_k) == large


def test_fixed_length_equals_optax_multisteps():
    inner = optax.sgd(0.1, momentum=0.9)
    ours = transforms.accordion_batch_size(
        inner, interval_steps=6, small_steps=3, large_steps=3, lr_scaling="none", axis_name=None
    )
    theirs = optax.MultiSteps(inner, every_k_schedule=3)
    s1, s2 = ours.init(PARAMS), theirs.init(PARAMS)
    update1, update2 = jax.jit(ours.update), jax.jit(theirs.update)
    rng = np.random.default_rng(4)
    for _ in range(9):
        g = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in PARAMS.items()}
        u1, s1 = update1(g, s1, PARAMS)
        u2, s2 = update2(g, s2, PARAMS)
        for k in PARAMS:
            np.testing.assert_allclose(u1[k], u2[k], rtol=1e-6, atol=1e-7)


def test_learning_rate_decrease_returns_to_the_small_batch():
    lrs = lambda count: jnp.where(count < 12, 0.1, 0.01)
    tx = transforms.accordion_batch_size(
        optax.sgd(0.1), interval_steps=4, large_steps=4, check_every=1, learning_rate=lrs,
        axis_name=None,
    )  # fmt: skip
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    ks = []  # the accumulation length in force after each micro-step
    for _ in range(16):
        _, state = update(grads_of(1.0), state)
        ks.append(int(state.every_k))
    assert ks[:7] == [1] * 7 and ks[7:12] == [4] * 5  # calm: large batch from interval 2
    assert ks[12:15] == [1] * 3  # the decay at step 12 returns to the small batch ...
    assert ks[15] == 4  # ... until the next check re-evaluates (calm: large again)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, 4)], devices=jax.devices()[:4])


def test_data_parallel_communicates_only_when_an_update_is_applied(mesh):
    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    inner = optax.chain(
        transforms.compressed_mean(feedback.error_feedback(compressors.quantize(8))),
        optax.sgd(0.05),
    )
    tx = transforms.accordion_batch_size(inner, interval_steps=2, large_steps=2, check_every=1)
    dp = parallel.data_parallel(loss_fn, tx, mesh)
    rng = np.random.default_rng(5)
    batch = (rng.standard_normal((16, 4)).astype(np.float32), rng.standard_normal((16, 3)))
    batch = (batch[0], batch[1].astype(np.float32))
    state = dp.init({k: jnp.asarray(d) for k, d in DIRECTION.items()})
    text = dp.step.lower(state, batch).compile().as_text()
    gathers = [r for r in comm.collective_report(text).records if r.kind == "all-gather"]
    assert gathers and all(r.computation != _entry(text) for r in gathers)  # inside the cond
    losses, ks = [], []
    for _ in range(8):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
        ks.append(int(transforms.batch_size_metrics(state.opt_state)["every_k"]))
    assert losses[-1] < losses[0]
    assert 2 in ks


def _entry(hlo_text):
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            return line.split()[1].lstrip("%")
    raise AssertionError("no ENTRY computation")


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.accordion_batch_size(compressors.top_k(0.1), interval_steps=2)
    with pytest.raises(ValueError, match="large_steps"):
        transforms.accordion_batch_size(
            optax.sgd(0.1), interval_steps=2, small_steps=4, large_steps=2
        )
    with pytest.raises(ValueError, match="lr_scaling"):
        transforms.accordion_batch_size(optax.sgd(0.1), interval_steps=2, lr_scaling="cubic")
    with pytest.raises(ValueError, match="small_steps"):
        transforms.accordion_batch_size(optax.sgd(0.1), interval_steps=2, small_steps=0)


def test_init_runs_outside_shard_map_and_places_on_the_mesh(mesh):
    inner = optax.chain(transforms.compressed_mean(compressors.quantize(8)), optax.sgd(0.1))
    tx = transforms.accordion_batch_size(inner, interval_steps=2)
    state = tx.init(PARAMS)  # axis "data", but no mesh and no shard_map needed
    assert state.accum.value["w"].shape == (1, 4, 3) and state.grads.value["b"].shape == (1, 3)
    placed = comm.place_state(state, comm.make_mesh([(comm.DATA, 4)], jax.devices()[:4]), comm.DATA)
    assert placed.accum.value["w"].shape == (4, 4, 3)
    assert placed.accum.value["w"].sharding.spec == P(comm.DATA)
    assert placed.every_k.sharding.spec == P()
