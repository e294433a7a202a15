"""AB-Training's options beyond the basic loop: grouping, comm setups, resets, moment alignment.

Expected values are worked out by hand or transcribed from the reference trainer
(``ABLowRankTrainer``, SPEC §3.4-3.5).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _factor as F

#: group sizes, byte counts and branch counts of the compiled programs (XLA's HLO passes are
#  the same with optimisations off: the compiled HLO text is identical), moments and learning
#  rates to a tolerance, exact zeros and signs by construction: the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")


def reference_groups(world, group_size):
    """``ABLowRankTrainer.__init__``'s grouping, transcribed (``-1``: two halves)."""
    ranks = list(range(world))
    if group_size == -1:
        return [ranks[: world // 2], ranks[world // 2 :]]
    num_groups, rem = world // group_size, world % group_size
    sizes = [group_size] * num_groups
    for r in range(rem):
        sizes[r] += 1  # IndexError when rem > num_groups
    return [ranks[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(num_groups)]


def test_group_sizes_follow_the_reference_rule():
    checked = 0
    for world in range(2, 17):
        want = [len(g) for g in reference_groups(world, -1)]
        assert list(transforms.group_sizes(world)) == want
        for group_size in range(1, world + 1):
            try:
                want = [len(g) for g in reference_groups(world, group_size)]
            except IndexError:  # the reference fails; we spread the remainder evenly
                got = transforms.group_sizes(world, group_size=group_size)
                assert sum(got) == world and max(got) - min(got) <= 1
                continue
            assert list(transforms.group_sizes(world, group_size=group_size)) == want
            checked += 1
    assert checked > 80
    assert transforms.group_sizes(7, group_size=2) == (3, 2, 2)
    assert transforms.group_sizes(8, num_groups=3) == (3, 3, 2)


PARAMS = {
    "conv": {"kernel": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros(8)},  # tall view (36, 8)
    "head": {"kernel": jnp.zeros((8, 3))},  # excluded
}
KWARGS = dict(learning_rate=1e-3, warmup_steps=2, sync_every=8, full_rank_steps=2,
              exclude=("head",), max_rank=3)  # fmt: skip
OTHER = [PARAMS["conv"]["bias"], PARAMS["head"]["kernel"]]


def test_individual_sends_no_factor_bytes_between_syncs():
    mesh = parallel.ab_mesh(2, jax.devices()[:8])
    config = transforms.ABConfig(**KWARGS, comm_setup="individual")
    reports = transforms.ab_step_bytes(PARAMS, mesh, config, kinds=("ab",))["ab"]
    for role in ("a", "b"):  # only the non-factorised parameters, within the group
        assert {(r.kind, r.group_size) for r in reports[role].records} == {("all-reduce", 4)}
        assert reports[role].total_bytes == compressors.wire_bytes(OTHER)


def test_flat_groups_reduce_in_rings_within_each_role_with_no_branch():
    """5 workers, group_size 2: groups of 3 (A) and 2 (B). The A-gradient goes round a ring
    of 3 (2 sends), the B-gradient round rings of 2 (1 send), the rest round both (2)."""
    mesh = comm.make_mesh([("data", 5)], jax.devices()[:5])
    config = transforms.ABConfig(**KWARGS, axis_name="data", group_size=2)
    state = jax.eval_shape(transforms.ab_training(**KWARGS).init, PARAMS)
    reports = transforms.ab_step_bytes(PARAMS, mesh, config, kinds=("ab",))["ab"]
    other = 2 * compressors.wire_bytes(OTHER)
    assert reports["a"].total_bytes == 2 * compressors.wire_bytes(state.a) + other
    assert reports["b"].total_bytes == compressors.wire_bytes(state.b) + other
    assert {r.kind for r in reports["a"].records} == {"collective-permute"}
    # the harness's AB program: the role is never a branch on the flat layout; its one
    # conditional is the sync at a cycle's last AB step (``reconstruct_or_sync``), beside the
    # finiteness check's (an int32 flag, no collective)
    text = _ab_program_text(config, mesh)
    assert text.count(" conditional(") == 2
    assert text.count(" = (s32[]) conditional(") == 1
    assert "ab_role_a" in text and "ab_role_b" in text and "ab_sync" in text


def _ab_program_text(config, mesh):
    from jaxcomp.ab import _programs

    def loss_fn(p, x):
        return jnp.mean((x.reshape(-1, 36) @ p["conv"]["kernel"].reshape(36, 8)) ** 2)

    programs = _programs.Programs(config, loss_fn, mesh)
    state = _programs.abstract_train_state(config, PARAMS, mesh)
    n = mesh.size
    batch = jax.ShapeDtypeStruct((n, 36), jnp.float32,
                                 sharding=jax.NamedSharding(mesh, P(config.axis_name)))  # fmt: skip
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=jax.NamedSharding(mesh, P()))
    return programs.compiled("ab", state, batch, flag).as_text()


# ---- a tiny model with constant gradients: hand-computed optimizer states -----------------

C = np.arange(24, dtype=np.float32).reshape(6, 4) / 24 - 0.5  # dL/dW
D = np.array([0.5, -1.0, 2.0, 0.25], np.float32)  # dL/db


def linear_loss(p, x):
    del x
    return jnp.sum(p["w"] * C) + jnp.sum(p["b"] * D)


def _w0():
    q1, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 4)))
    q2, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((4, 4)))
    return ((q1 * np.array([4.0, 3.0, 2.0, 1.0])) @ q2.T).astype(np.float32)


@functools.cache
def _run(**options):
    """12 steps: warm-up 2, S = 4, D = 1: steps 2-3 AB (sync after 3), 4 full rank (+
    re-factorisation), 5-7 AB, ...; one group of 2 workers (every group trains B). Cached: the
    moment and learning-rate tests read the same two runs (a harness's programs each)."""
    mesh = parallel.ab_mesh(1, jax.devices()[:2])
    options = {"learning_rate": 1e-3, "warmup_steps": 2, "sync_every": 4, "full_rank_steps": 1,
               "inner": optax.scale_by_adam(b1=0.9), **options}  # fmt: skip
    dp = parallel.ab_data_parallel(linear_loss, transforms.ABConfig(**options), mesh)
    state = dp.init({"w": jnp.asarray(_w0()), "b": jnp.zeros(4)})
    history = []
    for _ in range(12):
        state, metrics = dp.step(state, jnp.zeros((2, 1)))
        history.append((parallel.worker_entry(state.opt_state), metrics))
    return history


#: the learning rate's rebound (base 0.1, floor 0.01, R = 2), reset at each sync (the default)
#  with the moments reset too, or not reset at a sync with the moments kept: the moments do not
#  depend on the learning rate (the loss is linear: constant gradients), the rate not on them
REBOUND = dict(learning_rate=0.1, lr_rebound_steps=2, lr_rebound_floor=0.01)
KEPT = dict(REBOUND, reset_lr_on_sync=False)
RESET = dict(REBOUND, reset_opt=True)


def test_reset_opt_zeroes_every_moment_at_each_switch_and_keeps_the_counts():
    b1 = 0.9
    kept, reset = _run(**KEPT), _run(**RESET)
    # after step 2, the first AB step (the switch was at its start)
    k, r = kept[2][0], reset[2][0]
    np.testing.assert_allclose(k.dense_state.mu[0], (1 - b1**2) * C, rtol=1e-5)  # 2 warm-ups
    np.testing.assert_array_equal(r.dense_state.mu[0], 0.0)
    np.testing.assert_allclose(k.other_state.mu[0], (1 - b1**3) * D, rtol=1e-5)
    np.testing.assert_allclose(r.other_state.mu[0], (1 - b1) * D, rtol=1e-5)
    for s in (k, r):  # the B-gradient A^T C, once, from zero either way
        np.testing.assert_allclose(s.b_state.mu[0], (1 - b1) * (s.a[0].T @ C), rtol=1e-4,
                                   atol=1e-7)  # fmt: skip
        assert int(s.dense_state.count) == 2 and int(s.other_state.count) == 3
        assert int(s.b_state.count) == 1
    # after step 3 (AB, then the sync) and step 4 (full rank, then the re-factorisation)
    for t in (3, 4):
        r = reset[t][0]
        for moments in (r.dense_state, r.other_state, r.a_state, r.b_state):
            for x in (*moments.mu, *moments.nu):
                np.testing.assert_array_equal(x, 0.0)
    assert int(reset[4][0].other_state.count) == 5  # counts keep running
    assert np.abs(kept[4][0].other_state.mu[0]).max() > 0


def test_reset_lr_on_sync_switches_the_rebound():
    # base 0.1, floor 0.01, R = 2; phase switches at steps 2, 4, 5, 8, 9:
    # k = 1 -> 0.01; k = 2 -> min(0.1, 2 (0.1 - 0.01) / 2) = 0.09; later -> 0.1
    want = [0.1, 0.1, 0.01, 0.09, 0.01, 0.01, 0.09, 0.1, 0.01, 0.01, 0.09, 0.1]
    on, off = _run(**RESET), _run(**KEPT)
    np.testing.assert_allclose([float(m["lr"][0]) for _, m in on], want, rtol=1e-6)
    np.testing.assert_allclose([float(m["lr"][0]) for _, m in off], [0.1] * 12, rtol=1e-6)


# ---- moment alignment at a re-factorisation ---------------------------------------------


def _refactor_with_old_factors(align, order, signs):
    """A ``dense_then_refactor`` step (lr 0) whose old factors hold the new SVD's columns in
    ``order`` with ``signs``; returns the old moments and the new state."""
    mesh = parallel.ab_mesh(1, jax.devices()[:1])
    tx = transforms.ab_training(0.0, warmup_steps=0, sync_every=4, full_rank_steps=1,
                                low_rank_cutoff=1e-6, align_moments=align)  # fmt: skip
    w = _w0()
    u, s, vh = (np.asarray(x) for x in jax.jit(F.svd)(w))
    root = np.sqrt(s)
    old_a = (u * root)[:, order] * signs
    old_b = (root[:, None] * vh)[order] * signs[:, None]
    rng = np.random.default_rng(5)
    mu_a, nu_a = rng.standard_normal((6, 4)), rng.random((6, 4))
    mu_b, nu_b = rng.standard_normal((4, 4)), rng.random((4, 4))
    params = {"w": jnp.asarray(w)}
    state = tx.init(params)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    state = state._replace(
        count=jnp.asarray(4, jnp.int32),  # step 4: full rank, then the re-factorisation
        a=(f32(old_a),), b=(f32(old_b),),
        a_state=state.a_state._replace(mu=(f32(mu_a),), nu=(f32(nu_a),)),
        b_state=state.b_state._replace(mu=(f32(mu_b),), nu=(f32(nu_b),)),
    )  # fmt: skip

    def body(state, params):
        state, params = jax.tree.map(lambda x: x[0], (state, params))
        grads = jax.tree.map(jnp.zeros_like, params)
        return jax.tree.map(lambda x: x[None], tx.update(grads, state, params)[1])

    run = jax.shard_map(body, mesh=mesh, in_specs=P(("group", "member")),
                        out_specs=P(("group", "member")))  # fmt: skip
    new = jax.jit(run)(*parallel.stack_per_worker((state, params), mesh))
    return (mu_a, nu_a, mu_b, nu_b), parallel.worker_entry(new)


def test_a_sign_flipped_singular_vector_gets_a_sign_flipped_moment():
    order = np.array([0, 2, 1, 3])  # old columns 1 and 2 swapped
    signs = np.array([-1.0, 1.0, 1.0, -1.0])  # old columns 0 and 3 flipped
    (mu_a, nu_a, mu_b, nu_b), new = _refactor_with_old_factors(True, order, signs)
    # new column i continues old column j with old[:, j] = sign_j * new[:, order_j]
    inv = np.argsort(order)
    sign_new = signs[inv]
    np.testing.assert_allclose(new.a_state.mu[0], mu_a[:, inv] * sign_new, rtol=1e-6)
    np.testing.assert_allclose(new.a_state.nu[0], nu_a[:, inv], rtol=1e-6)  # no sign
    np.testing.assert_allclose(new.b_state.mu[0], mu_b[inv] * sign_new[:, None], rtol=1e-6)
    np.testing.assert_allclose(new.b_state.nu[0], nu_b[inv], rtol=1e-6)


def test_without_alignment_moments_stay_in_place_as_the_reference():
    order, signs = np.array([0, 2, 1, 3]), np.array([-1.0, 1.0, 1.0, -1.0])
    (mu_a, _, mu_b, _), new = _refactor_with_old_factors(False, order, signs)
    np.testing.assert_allclose(new.a_state.mu[0], mu_a, rtol=1e-6)
    np.testing.assert_allclose(new.b_state.mu[0], mu_b, rtol=1e-6)


def test_match_columns_leaves_new_directions_without_history():
    u = np.eye(4, dtype=np.float32)
    old = np.stack([np.ones(4) / 2, np.zeros(4), [0, 0, 1, 0], [0, 0, 0, -3]], axis=1)
    index, sign = F.match_columns(jnp.asarray(old, jnp.float32), jnp.asarray(u))
    # u_0..u_1 overlap (1, 1, 1, 1)/2 by 0.5 < 1/sqrt(2): new; u_2 = old 2; u_3 = -old 3
    np.testing.assert_array_equal(np.asarray(sign), [0, 0, 1, -1])
    assert list(np.asarray(index)[2:]) == [2, 3]


# ---- every layout x comm setup x sync mode: the groups agree after each sync --------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "axis,options",
    [
        (("group", "member"), dict(sync_mode="only-learned", comm_setup="individual")),
        (("group", "member"), dict(sync_mode="full", split_sigma=False)),
        ("data", dict(sync_mode="only-b", group_size=2)),
        ("data", dict(sync_mode="with-stale", num_groups=3, comm_setup="individual")),
    ],
)
def test_all_workers_agree_after_each_sync(axis, options):
    n = 6
    mesh = (parallel.ab_mesh(2, jax.devices()[:n]) if axis != "data"
            else comm.make_mesh([("data", n)], jax.devices()[:n]))  # fmt: skip

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    config = transforms.ABConfig(3e-2, warmup_steps=1, sync_every=3, full_rank_steps=1,
                                 axis_name=axis, **options)  # fmt: skip
    dp = parallel.ab_data_parallel(loss, config, mesh)
    state = dp.init({"w": jnp.asarray(_w0()), "b": jnp.full(4, 0.1)})
    rng = np.random.default_rng(0)
    for t in range(9):
        state, metrics = dp.step(state, rng.standard_normal((2 * n, 6)).astype(np.float32))
        assert np.asarray(metrics["finite"]).all()
        params = np.asarray(state.params["w"])
        if config.schedule.step_kind(t) == "ab_then_sync":
            np.testing.assert_allclose(params, np.broadcast_to(params[0], params.shape),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
        elif t in (4, 7):  # AB steps: the groups differ
            assert not np.allclose(params[0], params[-1])
