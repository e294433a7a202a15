"""AB-Training end to end vs an explicit single-device reference of the algorithm.

The reference below is written independently of the transform: a Python loop over steps on
the full batch, the SPEC §3.5 state machine, ``jax.grad`` of the explicitly factored model
``W = A @ B`` for the AB steps, and plain optax data-parallel steps otherwise.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.transforms import ABPhase
from jaxcomp.transforms import ABSchedule

#: the harness == an independent reference (and the optax transform) to tolerances, both compiled
#: alike in this module: no bit of XLA's optimised programs is pinned; compiled unoptimised, the
#: many small step programs compile faster
pytestmark = pytest.mark.usefixtures("fast_compiles")

WARMUP, EVERY, FULL, REBOUND = 3, 4, 1, 2
BASE_LR = optax.cosine_decay_schedule(0.05, 20, alpha=0.2)
FACTORED = ("l1", "l2")  # l1: (6, 5) tall; l2: (5, 8) wide, so its tall view is transposed


def _normal(rng, shape, scale=1.0):
    """numpy's normal draws as float32 (an eager ``jax.random`` compiles a program per shape)."""
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.float32(scale))


def init_params(seed):
    rng = np.random.default_rng(seed)
    return {
        "l1": {"kernel": _normal(rng, (6, 5), 2.5), "bias": jnp.zeros(5)},
        "l2": {"kernel": _normal(rng, (5, 8), 2.2), "bias": jnp.full(8, 0.1)},
        "head": {"kernel": _normal(rng, (8, 3), 2.8), "bias": jnp.zeros(3)},
    }


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    h = jnp.tanh(h @ params["l2"]["kernel"] + params["l2"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)


def make_batches(steps, n=16):
    """numpy batches: the tests slice and gather workers' rows for the references (each slice
    of a JAX array compiled a program of its own, eagerly)."""
    rng = np.random.default_rng(7)
    return [tuple(rng.standard_normal((n, d)).astype(np.float32) for d in (6, 3))
            for _ in range(steps)]  # fmt: skip


SHAPES = {"l1": (6, 5), "l2": (5, 8)}
INNER = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-2))


def tall(w):
    return w.T if w.shape[0] < w.shape[1] else w


def untall(w2, shape):
    return w2.T if shape[0] < shape[1] else w2


@functools.partial(jax.jit, static_argnames="sigma_on")
def split(w, sigma_on=None):
    """SVD split of a weight (``sigma_on=None``: sqrt on both; "a"/"b": Sigma on that factor).

    The same float32 LAPACK SVD as the transform: moments carry over re-factorisations by
    position (as the reference), so a singular vector with the opposite sign would meet the
    old moment with the opposite sign and the runs would differ (by design, not by error).
    """
    u, s, vh = jnp.linalg.svd(tall(w), full_matrices=False)
    if sigma_on is None:
        return u * jnp.sqrt(s), jnp.sqrt(s)[:, None] * vh
    return (u * s, vh) if sigma_on == "a" else (u, s[:, None] * vh)


@jax.jit  # the reference's AB steps clip outside a program: one compile, not one per op
def clip(grads, max_norm=0.05):  # small enough to act on these gradients
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / (norm + 1e-6)), grads)


def assemble(weights, other):
    p = {"head": other["head"]}
    for n in FACTORED:
        p[n] = {"kernel": weights[n], "bias": other[n]}
    return p


@jax.jit
def products(a, b):
    return {n: untall(a[n] @ b[n], SHAPES[n]) for n in FACTORED}


@jax.jit
def dense_grads(params, batch):
    return clip(jax.grad(loss_fn)(params, batch))


@functools.partial(jax.jit, static_argnums=0)
def factored_grads(role, a, b, other, batch):
    """``jax.grad`` of the explicitly factored model w.r.t. the trained factor and the rest."""

    def factored_loss(factor, other):
        w = products(factor, b) if role == "a" else products(a, factor)
        return loss_fn(assemble(w, other), batch)

    return jax.grad(factored_loss, (0, 1))(a if role == "a" else b, other)


@jax.jit
def adamw(grads, state, params, lr):
    updates, state = INNER.update(grads, state, params)
    return jax.tree.map(lambda p, u: p - lr * u, params, updates), state


@functools.cache
def _learning_rate(every):
    """The schedule's jitted learning rate, one program per ``every`` (not per reference)."""
    return jax.jit(ABSchedule(WARMUP, every, FULL).learning_rate(BASE_LR, REBOUND))


class Reference:
    """One group's AB-Training, written out step by step (per-role AdamW states)."""

    def __init__(self, params, role, sigma_on=None, every=EVERY):
        self.params, self.role, self.sigma_on = params, role, sigma_on
        self.sched = ABSchedule(WARMUP, every, FULL)
        self.lr = _learning_rate(every)
        fac = {n: params[n]["kernel"] for n in FACTORED}
        self.other = {
            "l1": params["l1"]["bias"],
            "l2": params["l2"]["bias"],
            "head": params["head"],
        }
        self.st_dense, self.st_other = INNER.init(fac), INNER.init(self.other)
        self.a = {n: jnp.zeros((max(SHAPES[n]), 5)) for n in FACTORED}
        self.b = {n: jnp.zeros((5, 5)) for n in FACTORED}
        self.st_a, self.st_b = INNER.init(self.a), INNER.init(self.b)

    def factorise(self):
        for n in FACTORED:
            self.a[n], self.b[n] = split(self.params[n]["kernel"], self.sigma_on)

    def grads(self, batch):
        """Unclipped AB-step gradients ``(factor, other)`` at this group's weights."""
        return factored_grads(self.role, self.a, self.b, self.other, batch)

    def step(self, t, batch, grads=None):
        """One step; an AB step may be given its (unclipped) ``grads`` instead of a batch."""
        lr, phase = self.lr(t), int(self.sched.phase(t))
        if phase == ABPhase.AB:
            if t == WARMUP:
                self.factorise()
            g_factor, g_other = clip(self.grads(batch) if grads is None else grads)
            if self.role == "a":
                self.a, self.st_a = adamw(g_factor, self.st_a, self.a, lr)
            else:
                self.b, self.st_b = adamw(g_factor, self.st_b, self.b, lr)
            self.other, self.st_other = adamw(g_other, self.st_other, self.other, lr)
            self.params = assemble(products(self.a, self.b), self.other)
        else:
            grads = dense_grads(self.params, batch)
            fac = {n: self.params[n]["kernel"] for n in FACTORED}
            g_fac = {n: grads[n]["kernel"] for n in FACTORED}
            g_other = {"l1": grads["l1"]["bias"], "l2": grads["l2"]["bias"], "head": grads["head"]}
            fac, self.st_dense = adamw(g_fac, self.st_dense, fac, lr)
            self.other, self.st_other = adamw(g_other, self.st_other, self.other, lr)
            self.params = assemble(fac, self.other)
            if phase == ABPhase.FULL and int(self.sched.phase(t + 1)) == ABPhase.AB:
                self.factorise()  # cutoff 1e-6 keeps every singular value here
                self.params = assemble(products(self.a, self.b), self.other)


def make_config(every=EVERY, **kwargs):
    """Moments carry over by position (``align_moments=False``), as the reference does."""
    kwargs.setdefault("align_moments", False)
    return transforms.ABConfig(
        BASE_LR, warmup_steps=WARMUP, sync_every=every, full_rank_steps=FULL, inner=INNER,
        low_rank_cutoff=1e-6, exclude=("head",), lr_rebound_steps=REBOUND, max_grad_norm=0.05,
        **kwargs,
    )  # fmt: skip


def assert_params_close(got, want, rtol=2e-4, atol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.slow
def test_one_group_without_truncation_is_plain_data_parallel_training():
    """G = 1: warm-up/full-rank steps are plain DP, AB steps train B of the exact factorisation.

    Covers every phase and transition: warm-up, first (exact) factorisation, AB, sync,
    full-rank rebound, re-factorisation; with AdamW, clipping and the LR rebound.
    """
    mesh = parallel.ab_mesh(1, jax.devices()[:4])
    dp = parallel.ab_data_parallel(loss_fn, make_config(), mesh)
    params = init_params(0)
    state, ref = dp.init(params), Reference(params, role="b")
    phases = []
    for t, batch in enumerate(make_batches(13)):
        want_loss = jax.jit(loss_fn)(ref.params, batch)
        state, metrics = dp.step(state, batch)
        ref.step(t, batch)
        assert_params_close(parallel.worker_entry(state.params), ref.params)
        np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
        np.testing.assert_allclose(metrics["lr"], ref.lr(t), rtol=1e-6)
        phases.append(int(np.max(metrics["phase"])))
    assert phases == [int(ref.sched.phase(t + 1)) for t in range(13)]
    assert set(phases) == {ABPhase.WARMUP, ABPhase.AB, ABPhase.FULL}


def _run_groups(config, mesh, params, batches, refs, shard_of_worker, group_of_worker):
    """Steps the harness and one reference per group; group g's AB steps see its shards;
    returns the state and the harness (to step it on)."""
    dp = parallel.ab_data_parallel(loss_fn, config, mesh)
    state = dp.init(params)
    for t, (x, y) in enumerate(batches):
        state, _ = dp.step(state, (x, y))
        for g, ref in enumerate(refs):
            rows = np.concatenate([shard_of_worker(w) for w in range(len(group_of_worker))
                                   if group_of_worker[w] == g])  # fmt: skip
            ref.step(t, (x, y) if t < WARMUP else (x[rows], y[rows]))
    return state, dp


@pytest.mark.slow
def test_each_group_trains_its_factor_on_its_own_data():
    """2 groups of 2, ``split_sigma=False``: group 0 trains A, group 1 trains B."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    params = init_params(1)
    refs = [Reference(params, r, sigma_on=r, every=8) for r in ("a", "b")]
    state, _ = _run_groups(make_config(every=8, split_sigma=False), mesh, params,
                        make_batches(WARMUP + 3), refs, lambda w: np.arange(4 * w, 4 * w + 4),
                        [0, 0, 1, 1])  # fmt: skip
    # the members of a group agree: one state entry per group
    assert jax.tree.leaves(state.params)[0].shape[0] == 2
    groups = [parallel.worker_entry(state.params, g) for g in range(2)]
    for got, ref in zip(groups, refs):
        assert_params_close(got, ref.params)
    assert not np.allclose(groups[0]["l1"]["kernel"], groups[1]["l1"]["kernel"])
    for g, ref in enumerate(refs):  # the factors too (SVD columns are defined up to sign)
        opt = parallel.worker_entry(state.opt_state, g)
        for i, n in enumerate(FACTORED):
            np.testing.assert_allclose(abs(opt.a[i]), abs(ref.a[n]), rtol=2e-4, atol=2e-5)
            np.testing.assert_allclose(abs(opt.b[i]), abs(ref.b[n]), rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_unequal_groups_on_a_flat_axis_train_and_sync_as_the_reference():
    """5 workers, group_size 2: groups of 3 (trains A) and 2 (trains B), as the reference
    spreads the remainder; the with-stale sync averages over workers (3:2)."""
    mesh = comm.make_mesh([("data", 5)], jax.devices()[:5])
    config = make_config(every=8, axis_name="data", group_size=2)
    params = init_params(2)
    refs = [Reference(params, r, every=8) for r in ("a", "b")]
    batches = make_batches(WARMUP + 5, n=15)  # steps 3-7 AB, the sync at the end of step 7
    state, dp = _run_groups(config, mesh, params, batches[:-1], refs,
                        lambda w: np.arange(3 * w, 3 * w + 3), [0, 0, 0, 1, 1])  # fmt: skip
    for w in range(5):
        assert_params_close(parallel.worker_entry(state.params, w), refs[w // 3].params)
    # the last AB step, then the sync: A and B averaged over the 5 workers (the same harness)
    state, _ = dp.step(state, batches[-1])
    x, y = batches[-1]
    refs[0].step(WARMUP + 4, (x[:9], y[:9]))
    refs[1].step(WARMUP + 4, (x[9:], y[9:]))
    want = {}
    for n in FACTORED:
        a = (3 * refs[0].a[n] + 2 * refs[1].a[n]) / 5
        b = (3 * refs[0].b[n] + 2 * refs[1].b[n]) / 5
        want[n] = untall(a @ b, SHAPES[n])
    for w in range(5):
        got = parallel.worker_entry(state.params, w)
        for n in FACTORED:
            np.testing.assert_allclose(got[n]["kernel"], want[n], rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_individual_workers_train_factors_on_their_own_gradients():
    """``comm_setup="individual"``: a worker's factor sees only its own shard's gradient; the
    biases and the head take the mean over the group's workers (SPEC §3.4)."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    config = make_config(every=8, comm_setup="individual")
    params = init_params(3)
    dp = parallel.ab_data_parallel(loss_fn, config, mesh)
    state = dp.init(params)
    refs = [Reference(params, "a" if w < 2 else "b", every=8) for w in range(4)]
    for t, (x, y) in enumerate(make_batches(WARMUP + 3)):
        state, _ = dp.step(state, (x, y))
        if t < WARMUP:
            for ref in refs:
                ref.step(t, (x, y))
            continue
        if t == WARMUP:
            for ref in refs:
                ref.factorise()
        own = [refs[w].grads((x[4 * w : 4 * w + 4], y[4 * w : 4 * w + 4])) for w in range(4)]
        for w, ref in enumerate(refs):
            g = w // 2
            other = jax.tree.map(lambda p, q: (p + q) / 2, own[2 * g][1], own[2 * g + 1][1])
            ref.step(t, None, grads=(own[w][0], other))
    for w, ref in enumerate(refs):
        assert_params_close(parallel.worker_entry(state.params, w), ref.params)
    kernels = [parallel.worker_entry(state.params, w)["l1"]["kernel"] for w in range(4)]
    assert not np.allclose(kernels[0], kernels[1])  # members of a group differ


def _user_loop_step(config, mesh):
    """The public transform (``lax.switch`` on the count) in a user's own ``shard_map``."""
    tx = transforms.ab_training(**{f.name: getattr(config, f.name)
                                   for f in dataclasses.fields(config)})  # fmt: skip
    axes, held = config.axis_name, config.state_axes(mesh)

    def body(params, opt_state, batch):
        params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
        _, grads = comm.local_value_and_grad(loss_fn, axes)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], (params, opt_state))

    specs = (P(held), P(held), P(axes))
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(held), P(held)))
    return tx, jax.jit(fn)


@pytest.mark.slow
def test_the_optax_transform_equals_the_harness_programs():
    """``tx.update`` (one program, ``lax.switch``) == the harness's programs, every kind."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    config = make_config(every=4, split_sigma=False, align_moments=True)
    params = init_params(4)
    tx, step = _user_loop_step(config, mesh)
    dp = parallel.ab_data_parallel(loss_fn, config, mesh)
    state = dp.init(params)
    held = config.state_axes(mesh)  # ("group",): one entry per group, as the harness
    p, o = parallel.stack_per_worker((params, tx.init(params)), mesh, held)  # init outside
    batches = make_batches(11)  # warm-up, AB, sync, full rank + re-factorisation, AB
    for x, y in batches:
        state, _ = dp.step(state, (x, y))
        p, o = step(p, o, dp.shard_batch((x, y)))
    assert_params_close(p, state.params, rtol=1e-5, atol=1e-6)
    assert_params_close(o, state.opt_state)  # moments: float32 rounding of fused programs
