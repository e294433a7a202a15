"""AB-Training syncs (averages worked out by hand, a NaN factor not hidden) and the bytes each
step kind puts on the wire."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import compressors
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER

#: hand-computed averages to rtol 1e-6 and the collectives' kinds, groups and bytes: no bit
#  of an optimised formula, so the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

GROUPS, MEMBERS = 4, 2


@functools.cache
def _program(sync_mode, options):
    """The jitted ``shard_map`` of one ``ab_training`` update (learning rate 0, zero
    gradients) per worker and the placed initial ``(state, params)``, one per sync mode and
    options (the NaN runs reuse them)."""
    mesh = parallel.ab_mesh(GROUPS, jax.devices()[: GROUPS * MEMBERS])
    tx = transforms.ab_training(0.0, warmup_steps=1, sync_every=4, full_rank_steps=1,
                                sync_mode=sync_mode, **dict(options))  # fmt: skip

    def body(state, params):
        state, params = jax.tree.map(lambda x: x[0], (state, params))
        grads = jax.tree.map(jnp.zeros_like, params)
        updates, state = tx.update(grads, state, params)
        new = jax.tree.map(lambda p, u: p + u, params, updates)
        return jax.tree.map(lambda x: x[None], (new, state))

    spec = P((GROUP, MEMBER))
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    params = {"w": jnp.zeros((4, 2)), "bias": jnp.zeros(3)}
    return run, parallel.stack_per_worker((tx.init(params), params), mesh)


def synced(sync_mode, count=3, nan_group=None, **options):
    """One ``ab_then_sync`` step (count 3) with learning rate 0, from hand-made factors.

    Group g (0..3) holds ``A = (g + 1) * ones(4, 2)`` (``ones`` in only-b, where A = U is
    shared), ``B = 10 (g + 1) * I`` and ``bias = g``; groups 0 and 1 are the A-groups;
    ``nan_group``: that group's ``A`` holds a NaN. The public transform runs in a user's
    ``shard_map`` on per-worker states.
    """
    run, (state, stacked) = _program(sync_mode, tuple(sorted(options.items())))
    g = np.repeat(np.arange(GROUPS, dtype=np.float32), MEMBERS)[:, None, None]  # per worker
    a = np.ones((GROUPS * MEMBERS, 4, 2), np.float32) * (1 if sync_mode == "only-b" else g + 1)
    b = 10 * (g + 1) * np.eye(2, dtype=np.float32)
    w = a @ b
    if nan_group is not None:  # in both members: a group's members hold equal factors
        a[nan_group * MEMBERS : (nan_group + 1) * MEMBERS, 2, 1] = np.nan
    stacked = dict(stacked)
    workers = NamedSharding(stacked["w"].sharding.mesh, P((GROUP, MEMBER)))
    put = lambda x: jax.device_put(x, workers)  # noqa: E731
    state = state._replace(
        count=put(np.full(GROUPS * MEMBERS, count, np.int32)), a=(put(a),), b=(put(b),)
    )
    stacked["bias"] = put(np.repeat(g[:, 0], 3, axis=1))
    stacked["w"] = put(w)
    new, state = run(state, stacked)
    return np.asarray(new["w"]), np.asarray(new["bias"]), state


# W after the sync, by hand (A-groups 0, 1; B-groups 2, 3):
#   with-stale:   mean(1, 2, 3, 4) * mean(10, 20, 30, 40) = 2.5 * 25 = 62.5
#   only-learned: mean(1, 2) * mean(30, 40) = 1.5 * 35 = 52.5
#   full:         mean(1*10, 2*20, 3*30, 4*40) = 300 / 4 = 75
#   only-b:       1 * mean(10, 20, 30, 40) = 25
# The biases (group g holds g), by the reference's rule where dense_sync is None: averaged
# (mean(0, 1, 2, 3) = 1.5) with comm_setup="groups" except in only-b, where its DDP re-wrap
# broadcasts rank 0's (0); a dense_sync option overrides the rule: "average" the mean (also
# in only-b), "first" rank 0's, "keep" each group its own (one program per sync mode and
# option: the options ride on the modes they change).
@pytest.mark.parametrize(
    "sync_mode,dense_sync,weight,a_after,b_after,bias",
    [pytest.param("with-stale", None, 62.5, 2.5, 25.0, [1.5] * 4, marks=pytest.mark.slow),
     ("only-learned", "first", 52.5, 1.5, 35.0, [0.0] * 4),
     ("full", "keep", 75.0, None, None, [0.0, 1.0, 2.0, 3.0]),
     pytest.param("only-b", None, 25.0, 1.0, 25.0, [0.0] * 4, marks=pytest.mark.slow),
     pytest.param("only-b", "average", 25.0, 1.0, 25.0, [1.5] * 4, marks=pytest.mark.slow)],
)  # fmt: skip
def test_sync_modes_give_the_hand_computed_averages(
    sync_mode, dense_sync, weight, a_after, b_after, bias
):
    w, got_bias, state = synced(sync_mode, dense_sync=dense_sync)
    n = GROUPS * MEMBERS
    np.testing.assert_allclose(w, np.full((n, 4, 2), weight), rtol=1e-6)
    want_bias = np.broadcast_to(np.repeat(bias, MEMBERS)[:, None], (n, 3))
    np.testing.assert_allclose(got_bias, want_bias, rtol=1e-6)
    if a_after is not None:
        np.testing.assert_allclose(np.asarray(state.a[0]), np.full((n, 4, 2), a_after), rtol=1e-6)
        want_b = np.broadcast_to(b_after * np.eye(2), (n, 2, 2))
        np.testing.assert_allclose(np.asarray(state.b[0]), want_b, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.phase), transforms.ABPhase.FULL)
    if sync_mode == "only-b":  # A = U is shared: no group's own A
        return
    # a NaN in one group's factor reaches every worker's synced weights (the harness's
    # ``finite`` metric then reports the step), never a finite weight computed from it: in an
    # A-group's A, and in a B-group's A, which only-learned does not average (the group's B
    # gradient A^T G reads it); the same program
    for group in (0, GROUPS - 1):
        w, _, _ = synced(sync_mode, nan_group=group, dense_sync=dense_sync)
        assert np.all(np.isnan(w).any(axis=(1, 2))), (sync_mode, group)


def test_individual_mode_takes_worker_0s_biases_at_a_sync_as_the_reference():
    _, bias, _ = synced("with-stale", comm_setup="individual")
    np.testing.assert_allclose(bias, 0.0)


PARAMS = {
    "conv": {"kernel": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros(8)},  # tall view (36, 8)
    "dense": {"kernel": jnp.zeros((8, 16))},  # wide: tall view (16, 8)
    "head": {"kernel": jnp.zeros((16, 3))},  # excluded
}
KWARGS = dict(
    learning_rate=1e-3, warmup_steps=2, sync_every=8, full_rank_steps=2, exclude=("head",),
    max_rank=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def step_bytes():
    mesh = parallel.ab_mesh(2, jax.devices()[:8])
    return transforms.ab_step_bytes(PARAMS, mesh, transforms.ABConfig(**KWARGS))


def _groups_and_bytes(report):
    return {(r.kind, r.group_size) for r in report.records}, report.total_bytes


@pytest.mark.slow
def test_ab_steps_send_only_the_trained_factor_within_the_group(step_bytes):
    state = jax.eval_shape(transforms.ab_training(**KWARGS).init, PARAMS)
    assert [x.shape for x in state.a] == [(36, 3), (16, 3)]
    assert [x.shape for x in state.b] == [(3, 8), (3, 8)]
    other = [PARAMS["conv"]["bias"], PARAMS["head"]["kernel"]]
    for role, factor in (("a", state.a), ("b", state.b)):
        kinds, total = _groups_and_bytes(step_bytes["ab"][role])
        assert kinds == {("all-reduce", MEMBERS * 2)}  # the 4 members of a group only
        assert total == compressors.wire_bytes(factor) + compressors.wire_bytes(other)
    dense_bytes = compressors.wire_bytes(PARAMS)
    assert step_bytes["ab"]["a"].total_bytes < dense_bytes / 2


def test_full_rank_steps_and_transitions_send_what_they_should(step_bytes):
    state = jax.eval_shape(transforms.ab_training(**KWARGS).init, PARAMS)
    dense = compressors.wire_bytes(PARAMS)
    kinds, total = _groups_and_bytes(step_bytes["dense"]["all"])
    assert kinds == {("all-reduce", 8)} and total == dense
    # + the agreed ranks (pmax of one int32 per factorised weight)
    _, total = _groups_and_bytes(step_bytes["dense_then_refactor"]["all"])
    assert total == dense + 4 * len(state.a)
    # with-stale sync: A, B and the dense parameters, averaged over the 2 groups
    other = [PARAMS["conv"]["bias"], PARAMS["head"]["kernel"]]
    sync = compressors.wire_bytes((state.a, state.b, other))
    for role in ("a", "b"):
        kinds, total = _groups_and_bytes(step_bytes["ab_then_sync"][role])
        assert kinds == {("all-reduce", 4), ("all-reduce", 2)}
        assert total == step_bytes["ab"][role].total_bytes + sync


def test_group_and_member_axes_are_the_mesh_axes():
    mesh = parallel.ab_mesh(2, jax.devices()[:8])
    assert dict(mesh.shape) == {GROUP: 2, MEMBER: 4}


def test_reduce_dense_globally_averages_dense_parameters_over_all_workers():
    mesh = parallel.ab_mesh(2, jax.devices()[:8])
    kwargs = {**KWARGS, "reduce_dense_globally": True}
    config = transforms.ABConfig(**kwargs)
    report = transforms.ab_step_bytes(PARAMS, mesh, config, kinds=("ab",))["ab"]["b"]
    state = jax.eval_shape(transforms.ab_training(**kwargs).init, PARAMS)
    by_group = {}
    for r in report.records:
        by_group[r.group_size] = by_group.get(r.group_size, 0) + r.total_bytes
    other = [PARAMS["conv"]["bias"], PARAMS["head"]["kernel"]]
    assert by_group == {4: compressors.wire_bytes(state.b), 8: compressors.wire_bytes(other)}
