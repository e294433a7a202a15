"""data_parallel over a (slow, fast) axis pair of a 2 x 4 mesh: the batch split over both axes,
per-worker optimizer state per slow worker; == the same training over a flat 8-worker axis."""

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

SLOW, FAST = "slow", "fast"
RNG = np.random.default_rng(1)
PARAMS = {"w": RNG.standard_normal((6, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
BATCH = {"x": RNG.standard_normal((16, 6)).astype(np.float32),
         "y": RNG.standard_normal((16, 3)).astype(np.float32)}  # fmt: skip


def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(SLOW, 2), (FAST, 4)])


def _train(tx, mesh, axis_name, steps=2):
    dp = parallel.data_parallel(loss_fn, optax.chain(tx, optax.sgd(0.1)), mesh,
                                axis_name=axis_name)  # fmt: skip
    state = dp.init(PARAMS)
    losses = []
    for _ in range(steps):
        state, metrics = dp.step(state, BATCH)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_the_pair_equals_a_flat_data_axis_of_eight(mesh):
    flat = comm.make_mesh([(comm.DATA, 8)])
    want, want_loss = _train(transforms.compressed_mean(compressors.identity()), flat, comm.DATA)
    got, got_loss = _train(
        transforms.compressed_mean(compressors.identity(), (SLOW, FAST)), mesh, (SLOW, FAST)
    )
    for k in PARAMS:
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    # and it trained: the full-batch loss of the first step, then a lower one
    assert got_loss[0] == pytest.approx(float(loss_fn(PARAMS, BATCH)), rel=1e-5)
    assert got_loss[1] < got_loss[0]


def test_per_worker_state_belongs_to_a_slow_worker(mesh):
    """EF residuals: one per slow worker (the fast axis is averaged densely first), sharded over
    slow; the compressed run is the one a hand-written shard_map of the same tx gives."""
    tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.25)), (SLOW, FAST))
    state, losses = _train(tx, mesh, (SLOW, FAST))
    residual = state.opt_state[0].leaves["w"].memory.residual.value
    assert residual.shape == (2, 6, 3) and residual.sharding.spec == P(SLOW)
    assert np.any(np.asarray(residual) != 0)  # TopK 25% kept something back
    assert all(np.isfinite(losses))

    # by hand: the local gradients of each device's batch slice, the same tx under shard_map
    chain = optax.chain(tx, optax.sgd(0.1))
    with jax.set_mesh(mesh):
        opt = comm.place_state(chain.init(PARAMS), mesh, SLOW)
    specs = comm.state_specs(opt, SLOW)

    def body(params, opt, batch):
        _, grads = comm.local_value_and_grad(loss_fn, (SLOW, FAST))(params, batch)
        updates, opt = chain.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P((SLOW, FAST))),
                                 out_specs=(P(), specs)))  # fmt: skip
    params = PARAMS
    for _ in range(2):
        params, opt = step(params, opt, BATCH)
    for k in PARAMS:
        np.testing.assert_allclose(state.params[k], params[k], rtol=1e-6, atol=1e-7)


def test_a_tx_that_does_not_average_over_the_fast_axis_is_named(mesh):
    slow_only = transforms.compressed_mean(compressors.identity(), SLOW)
    dp = parallel.data_parallel(loss_fn, optax.chain(slow_only, optax.sgd(0.1)), mesh,
                                axis_name=(SLOW, FAST))  # fmt: skip
    with pytest.raises(ValueError, match="must average gradients over"):
        dp.step(dp.init(PARAMS), BATCH)


@pytest.mark.parametrize(
    ("axis_name", "match"),
    [
        ((SLOW, SLOW), "pair of distinct names"),
        ((SLOW, FAST, "x"), "pair of distinct names"),
        ((SLOW, "host"), "'host' is not an axis of the mesh"),
        (None, "needs an axis_name"),
        (3, "must be a mesh axis name"),
    ],
)
def test_bad_axis_names_are_named(mesh, axis_name, match):
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))
    with pytest.raises(ValueError, match=match):
        parallel.data_parallel(loss_fn, tx, mesh, axis_name=axis_name)


def test_a_model_state_with_a_pair_is_refused(mesh):
    tx = optax.chain(transforms.compressed_mean(compressors.identity(), (SLOW, FAST)),
                     optax.sgd(0.1))  # fmt: skip
    with pytest.raises(ValueError, match=r"has_state=True\) takes one data axis"):
        parallel.data_parallel(loss_fn, tx, mesh, axis_name=(SLOW, FAST), has_state=True)


def test_a_sharded_mean_and_the_metrics_leave_no_collective_over_all_eight(mesh):
    """shard_fast: the per-device state placed over the pair; the loss's mean over fast, then
    slow (a flat 8-rank ring would cross the slow links 14 hops deep): no collective spans the
    whole mesh, and the run equals the unsharded one."""
    ef = feedback.error_feedback(compressors.top_k(0.25))
    runs = {}
    for shard in (False, True):
        tx = optax.chain(transforms.compressed_mean(ef, (SLOW, FAST), shard_fast=shard),
                         optax.sgd(0.1))  # fmt: skip
        dp = parallel.data_parallel(loss_fn, tx, mesh, axis_name=(SLOW, FAST))
        state = dp.init(PARAMS)
        losses = []
        for _ in range(2):
            state, metrics = dp.step(state, BATCH)
            losses.append(float(metrics["loss"]))
        runs[shard] = state, losses
    state, losses = runs[True]
    residual = state.opt_state[0].leaves["w"].value.memory.residual.value
    assert residual.shape == (2, 4, 1, 6, 3) and residual.sharding.spec == P(SLOW, FAST)
    assert losses == runs[False][1]
    for k in PARAMS:
        np.testing.assert_array_equal(state.params[k], runs[False][0].params[k])
    report = comm.measure_collectives(dp.step, state, BATCH)
    assert {r.group_size for r in report.records} == {2, 4}, report.records
