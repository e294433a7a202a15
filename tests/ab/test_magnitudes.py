"""AB-Training's re-factorisation and sync at the edges: zero, rank-1 and rank-deficient
weights at magnitudes 1e-30 .. 3e38 (the cutoff is relative: the kept rank must not depend on
magnitude), against float64 numpy references (a NaN factor at a sync: tests/ab/test_sync.py,
on its sync modes' programs)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _factor as F
from jaxcomp.ab import _transform
from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER

MAGNITUDES = [1e-30, 1e-10, 1.0, 1e6, 1e30, 3e38]
CUTOFF = 0.15
ROWS, COLS = 8, 4


def matrix(singular_values):
    """An 8 x 4 float64 matrix with these singular values (random singular vectors)."""
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((ROWS, COLS)))
    v, _ = np.linalg.qr(rng.standard_normal((COLS, COLS)))
    return (u * np.asarray(singular_values, np.float64)) @ v.T


def truncated(w, cutoff=CUTOFF):
    """float64 reference: the kept rank and the truncated ``W``."""
    u, s, vh = np.linalg.svd(w, full_matrices=False)
    rank = max(int(np.sum(s > cutoff * s[0])), 1)
    return rank, (u[:, :rank] * s[:rank]) @ vh[:rank]


DEFICIENT = matrix([1.0, 0.5, 0.05, 0.0])  # rank 3, of which the cutoff keeps 2
RANK_ONE = matrix([1.0, 0.0, 0.0, 0.0])
# entries 3e38 and 2.7e38, two orthogonal row patterns: sigma ~ 1.2e39 and 1.1e39, beyond float32
FULL_SCALE = np.where(np.arange(ROWS)[:, None] % 2, [1.0, 1.0, 1.0, 1.0], [0.9, -0.9, 0.9, -0.9])


@pytest.fixture(scope="module")
def refactorise():
    @jax.jit
    def run(w):
        u, s, vh, k = F.scaled_svd(w)
        rank = F.cutoff_rank(s, CUTOFF)
        out = {}
        for split, on_a in ((True, True), (False, True), (False, False)):
            a, b = F.factors_from_svd(u, s, vh, rank, COLS, split_sigma=split,
                                      sigma_on_a=on_a, dtype=jnp.float32, scale=k)  # fmt: skip
            out[split, on_a] = a, b
        return rank, out

    return run


@pytest.mark.user_numerics
@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("name", ["deficient", "rank_one"])
def test_refactorisation_keeps_the_same_rank_at_every_magnitude(refactorise, name, magnitude):
    w = {"deficient": DEFICIENT, "rank_one": RANK_ONE}[name]  # sigma_0 = 1, entries below
    w32 = np.float32(w * magnitude)
    want_rank, want = truncated(np.float64(w32))
    rank, out = refactorise(jnp.asarray(w32))
    assert int(rank) == want_rank == {"deficient": 2, "rank_one": 1}[name]
    for (split, _), (a, b) in out.items():
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), split
        a, b = np.float64(a), np.float64(b)
        np.testing.assert_allclose(
            (a @ b) / magnitude, want / magnitude, rtol=0, atol=1e-5 * np.abs(w).max()
        )


@pytest.mark.user_numerics
def test_refactorisation_of_singular_values_beyond_float32(refactorise):
    """sigma ~ 1.2e39: the split factors (sqrt(sigma)) are finite and exact; a factor that
    must hold sigma_0 itself is Inf (not representable), never a finite wrong value."""
    w32 = np.float32(FULL_SCALE * 3e38)
    want_rank, want = truncated(np.float64(w32))
    rank, out = refactorise(jnp.asarray(w32))
    assert int(rank) == want_rank == 2
    a, b = (np.float64(x) for x in out[True, True])
    np.testing.assert_allclose(a @ b, want, rtol=1e-5)
    for on_a in (True, False):
        a, b = (np.asarray(x) for x in out[False, on_a])
        holder = a if on_a else b
        assert not np.all(np.isfinite(holder))
        other = b if on_a else a
        assert np.all(np.isfinite(other))


@pytest.mark.user_numerics
def test_refactorisation_of_an_all_zero_weight(refactorise):
    rank, out = refactorise(jnp.zeros((ROWS, COLS)))
    assert int(rank) == 1
    for a, b in out.values():
        assert not np.any(np.asarray(a) @ np.asarray(b))
        assert np.all(np.isfinite(np.asarray(a))) and np.all(np.isfinite(np.asarray(b)))


# ----------------------------------------------------------------------------------------------
# through the public transform (a sharded state per worker, as tests/transforms/test_ab_sync.py)

GROUPS, MEMBERS = 2, 2
N = GROUPS * MEMBERS
OPTIONS = dict(warmup_steps=1, sync_every=4, full_rank_steps=1, low_rank_cutoff=CUTOFF)
REFACTOR = 4  # the step count of a re-factorisation (asserted below)


def make_step(**options):
    """``step(count, w, a, b)``: one ``ab_training`` update at ``count`` (lr 0, zero
    gradients) of workers that all hold ``w``, worker ``i`` the factors ``a[i]``, ``b[i]``;
    returns each worker's new ``w`` and the state."""
    mesh = parallel.ab_mesh(GROUPS, jax.devices()[:N])
    tx = transforms.ab_training(0.0, **OPTIONS, **options)
    params = {"w": jnp.zeros((ROWS, COLS))}
    state0, _ = parallel.stack_per_worker((tx.init(params), params), mesh)
    workers = NamedSharding(mesh, P((GROUP, MEMBER)))
    spec = P((GROUP, MEMBER))

    def body(state, params):  # one worker's: zero gradients
        state, params = jax.tree.map(lambda x: x[0], (state, params))
        updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(params, updates), state))

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))

    def step(count, w, a, b):
        put = lambda x: jax.device_put(np.float32(x), workers)  # noqa: E731
        state = state0._replace(
            count=jax.device_put(np.full(N, count, np.int32), workers), a=(put(a),), b=(put(b),)
        )
        new, state = run(state, {"w": put(np.broadcast_to(w, (N, ROWS, COLS)))})
        return np.asarray(new["w"]), state

    return step


def test_the_count_used_is_a_refactorisation():
    schedule = transforms.ABConfig(0.0, **OPTIONS).schedule
    index = int(_transform.kind_index(schedule, jnp.asarray(REFACTOR)))
    assert _transform.STEP_KINDS[index] == "dense_then_refactor"


@pytest.mark.user_numerics
@pytest.mark.parametrize("split_sigma", [True, False])
def test_ab_training_refactorises_alike_at_every_magnitude(split_sigma):
    step = make_step(split_sigma=split_sigma)
    zeros_a, zeros_b = np.zeros((N, ROWS, COLS)), np.zeros((N, COLS, COLS))
    for magnitude in [0.0, *MAGNITUDES]:
        w32 = np.float32(DEFICIENT * magnitude)
        want_rank, want = truncated(np.float64(w32)) if magnitude else (1, np.zeros_like(w32))
        new, state = step(REFACTOR, w32, zeros_a, zeros_b)
        assert np.asarray(state.rank).tolist() == [[want_rank]] * N, magnitude
        assert np.all(np.isfinite(np.asarray(state.a[0]))), magnitude
        assert np.all(np.isfinite(np.asarray(state.b[0]))), magnitude
        scale = magnitude or 1.0
        want = np.broadcast_to(want / scale, new.shape)
        np.testing.assert_allclose(np.float64(new) / scale, want, rtol=0, atol=1e-5,
                                   err_msg=str(magnitude))  # fmt: skip
