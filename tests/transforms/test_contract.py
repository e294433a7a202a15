"""The contract every transform keeps, as optax users compose it (mirrors the codec contract).

Each transform (``compressed_mean`` on every collective path, ``accordion``,
``accordion_batch_size``) is initialised outside ``shard_map`` on plain parameters, placed with
``comm.place_state``, and run on per-worker gradients inside ``shard_map`` over 4 workers:

* plain, jitted (the reference every other form is compared with);
* built through ``optax.inject_hyperparams``, in ``optax.chain`` with ``optax.sgd``, inside
  ``optax.MultiSteps(k=2)``, under ``lax.cond`` (one program): nothing for a micro-step, then
  ``-lr`` times the reference's update of the two micro-batches' mean; the new state has
  exactly the old state's types (``jax.typeof``: shape, dtype, sharding and varying axes), so
  the transform can sit in a branch; ``False`` leaves the state as it was;
* on bfloat16 and float16 parameters and gradients: updates of that dtype close to the
  float32 reference, and a compressed mean's ``bytes_sent`` equal to its compiled bytes.

``ab_training`` (an optimizer alias, its state one entry per worker group) has its own cases at
the end: every step kind, init outside ``shard_map``, last in a chain, its learning rate
through ``inject_hyperparams``, state types under ``lax.cond``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms

#: each check compares two programs of this process (transform == its plain updates in a
#  chain, under inject_hyperparams, MultiSteps, cond) to a tolerance, or a passthrough exactly:
#  no bit of an optimised formula, so the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
AXIS = comm.DATA
PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((6,))}
LR = 0.1


@dataclasses.dataclass(frozen=True)
class Case:
    """A transform factory and the keyword arguments it is built with."""

    name: str
    factory: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    static: tuple = ()  # the arguments optax.inject_hyperparams must keep static
    needs_mesh: bool = False  # init sized by the number of workers (two-phase path)
    # PowerSGD's factors stay float32: a small bfloat16 matrix may be averaged densely
    same_plan_in_bfloat16: bool = True

    def build(self, **overrides):
        return self.factory(*self.args, **{**self.kwargs, **overrides})


def _mean_case(path, channel, **kwargs):
    return Case(
        f"compressed_mean/{path}",
        transforms.compressed_mean,
        (channel,),
        {"path": path, **kwargs},
        static=("min_compression_rate", "min_ndim", "warmup_steps", "seed"),
        needs_mesh=path == "two_phase",
    )


CASES = [
    _mean_case("dense", feedback.error_feedback(compressors.top_k(0.25))),
    _mean_case("psum", feedback.error_feedback(compressors.rand_k(0.25)), warmup_steps=1),
    _mean_case("all_gather", feedback.error_feedback(compressors.top_k(0.25))),
    _mean_case("two_phase", feedback.error_feedback(compressors.top_k(0.25))),
    _mean_case("codec", feedback.error_feedback(compressors.power_sgd(2))),
    _mean_case("auto", feedback.ef21(compressors.quantize(4))),
    Case(  # low compression falls back to a dense mean (too small for rank 2), high is PowerSGD
        "accordion/dense_low",
        transforms.accordion,
        (compressors.power_sgd(2), compressors.power_sgd(1)),
        {"interval_steps": 1, "check_every": 1, "eta": 0.5},
        static=("interval_steps", "check_every", "min_compression_rate", "min_ndim", "seed"),
        same_plan_in_bfloat16=False,
    ),
    Case(
        "accordion",
        transforms.accordion,
        (compressors.power_sgd(2), compressors.power_sgd(1)),
        # min_compression_rate=0: both modes compress at float32 and bfloat16 alike (PowerSGD's
        # factors stay float32, so at this size a bfloat16 matrix would be averaged densely)
        {"interval_steps": 1, "check_every": 1, "eta": 0.5, "min_compression_rate": 0},
        static=("interval_steps", "check_every", "min_compression_rate", "min_ndim", "seed"),
    ),
    Case(
        "accordion_batch_size",
        transforms.accordion_batch_size,
        (optax.chain(transforms.compressed_mean(compressors.top_k(0.25)), optax.sgd(1.0)),),
        {"interval_steps": 1, "check_every": 1, "small_steps": 1, "large_steps": 2, "eta": 0.5},
        static=("interval_steps", "check_every", "small_steps", "large_steps"),
    ),
]
BF16_CASES = [c for c in CASES if c.same_plan_in_bfloat16]


#: the compressed mean's paths whose composition with optax's wrappers (chain,
#: inject_hyperparams, MultiSteps, cond) runs in the slow tier only: the wrappers see the
#: transform's state, not its collectives, and the fast tier keeps a stateless channel path
#: (dense), the mesh-sized state (two_phase) and EF21's (auto); every path's own collectives
#: and bytes stay in the fast tier (test_16_bit_params, tests/comm/test_reduce.py)
WRAPPED_SLOW = ("compressed_mean/psum", "compressed_mean/all_gather", "compressed_mean/codec")


def _params(cases, slow_too=()):
    """The cases as parameters; Accordion's (seconds of compile each) and ``slow_too`` in the
    slow tier."""
    slow = [pytest.mark.slow]
    return [
        pytest.param(
            c, id=c.name, marks=slow if "accordion" in c.name or c.name in slow_too else ()
        )
        for c in cases
    ]


def _worker_grads(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((W, *v.shape)).astype(np.float32) for k, v in PARAMS.items()}
    return {k: jnp.asarray(v, dtype) for k, v in grads.items()}


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(AXIS, W)], devices=jax.devices()[:W])


def _init(case, tx, params, mesh):
    """``tx.init`` outside ``shard_map`` (under the mesh only where the state is sized by W)."""
    if case.needs_mesh:
        with jax.set_mesh(mesh):
            return tx.init(params)
    return tx.init(params)


def _local(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _runner(tx, state, mesh, grads):
    """``(state, grads[W, ...]) -> (updates, state)`` with ``tx.update`` inside ``shard_map``,
    compiled (once: a jitted call and a ``lower`` of the same function compiled it twice)."""
    specs = comm.state_specs(state, AXIS)

    def body(state, grads):
        return tx.update(_local(grads), state, PARAMS)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=(P(), specs))
    )
    return step.lower(state, grads).compile()


def _put(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


def _run(case, tx, mesh, grads_seq, params=PARAMS, every_state=False, step=None):
    """Updates of ``tx`` (built from ``case``) on each per-worker gradient in ``grads_seq``,
    the last state (``every_state``: the state after each step) and the compiled step (``step``:
    one compiled before for ``tx``'s state and gradients)."""
    state = comm.place_state(_init(case, tx, params, mesh), mesh, AXIS)
    grads_seq = [_put(grads, mesh) for grads in grads_seq]
    step = step or _runner(tx, state, mesh, grads_seq[0])
    out, states = [], []
    for grads in grads_seq:
        updates, state = step(state, grads)
        out.append(jax.tree.map(np.asarray, updates))
        states.append(state)
    return out, states if every_state else state, step


GRADS = [_worker_grads(seed) for seed in range(1, 7)]  # 3 pairs of micro-batches
#: what ``optax.MultiSteps(k=2)`` hands the inner transform at each pair's second micro-step,
#: the two micro-batches' running mean
#  (numpy float32: an eager JAX op at import compiles a program)
MEANS = [
    {k: np.asarray(a[k]) + (np.asarray(b[k]) - np.asarray(a[k])) / np.float32(2) for k in a}
    for a, b in zip(GRADS[::2], GRADS[1::2])
]


@pytest.fixture(scope="module")
def reference(mesh):
    """Each case's plain updates on MEANS (``step``: and its compiled step)."""
    cache = {}

    def get(case, step=False):
        if case.name not in cache:
            out, _, compiled = _run(case, case.build(), mesh, MEANS)
            cache[case.name] = out, compiled
        return cache[case.name] if step else cache[case.name][0]

    return get


def _assert_trees_equal(got, want, **tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if tol:
            np.testing.assert_allclose(np.asarray(g, np.float32), w, **tol)
        else:
            np.testing.assert_array_equal(g, w)


def _moved(updates_seq):
    """The reference must move the parameters (a contract check on all-zero updates is void)."""
    return all(any(np.any(u != 0) for u in jax.tree.leaves(upd)) for upd in updates_seq)


@functools.cache
def _jitted_inits(needs_mesh, mesh):
    """``{name: state}``: the ``init`` of every case with this ``needs_mesh``, jitted as one
    program (one compile, not one per case; under the mesh where the state is sized by W)."""
    txs = {c.name: c.build() for c in CASES if c.needs_mesh == needs_mesh}
    jitted = jax.jit(lambda params: {name: tx.init(params) for name, tx in txs.items()})
    if needs_mesh:
        with jax.set_mesh(mesh):
            return jitted(PARAMS)
    return jitted(PARAMS)


@pytest.mark.parametrize("case", _params(CASES))
def test_init_outside_shard_map_is_abstractly_stable(case, mesh):
    tx = case.build()
    state = _init(case, tx, PARAMS, mesh)
    again = _jitted_inits(case.needs_mesh, mesh)[case.name]
    assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, again)
    placed = comm.place_state(state, mesh, AXIS)
    assert jax.tree.structure(placed) == jax.tree.structure(state)


@pytest.mark.parametrize("case", _params(CASES, WRAPPED_SLOW))
def test_injected_in_an_optax_chain_in_multisteps_under_cond(case, mesh, reference):
    """``MultiSteps(chain(inject_hyperparams(transform), sgd(LR)), k=2)`` inside ``lax.cond``,
    one program per case (a program per wrapper cost a compile each): the dynamic
    hyperparameters in the injected state; ``True`` gives a zero update for each first
    micro-step and ``-LR`` times the reference's updates on the two micro-batches' running mean
    step after step, with the new state of exactly the old state's types; ``False`` zero
    updates and the state as it was. optax accumulates per worker, so the accumulator is
    placed per worker like the gradients."""
    injected = optax.inject_hyperparams(case.factory, static_args=case.static)
    tx = optax.MultiSteps(
        optax.chain(injected(*case.args, **case.kwargs), optax.sgd(LR)), every_k_schedule=2
    )
    state = _init(case, tx, PARAMS, mesh)
    dynamic = set(case.kwargs) - set(case.static) - {"path"}
    hyperparams = state.inner_opt_state[0].hyperparams
    assert dynamic <= set(hyperparams), (dynamic, hyperparams)
    acc = jax.tree.map(lambda a: jnp.broadcast_to(a, (W, *a.shape)), state.acc_grads)
    state = comm.place_state(state._replace(acc_grads=None), mesh, AXIS)._replace(
        acc_grads=_put(acc, mesh)
    )
    specs = comm.state_specs(state._replace(acc_grads=None), AXIS)._replace(acc_grads=P(AXIS))
    seen = {}

    def body(state, grads, pred):
        grads = _local(grads)
        state = state._replace(acc_grads=_local(state.acc_grads))

        def run(s):
            updates, new = tx.update(grads, s, PARAMS)
            seen["old"] = jax.tree.map(jax.typeof, s)
            seen["new"] = jax.tree.map(jax.typeof, new)
            return updates, new

        def skip(s):
            return jax.tree.map(jnp.zeros_like, PARAMS), s

        updates, state = lax.cond(pred, run, skip, state)
        return updates, state._replace(acc_grads=jax.tree.map(lambda a: a[None], state.acc_grads))

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AXIS), P()), out_specs=(P(), specs))
    )
    zeros, same = step(state, _put(GRADS[0], mesh), jnp.asarray(False))
    assert seen["old"] == seen["new"]
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(zeros))
    _assert_trees_equal(jax.tree.map(np.asarray, same), jax.tree.map(np.asarray, state))
    want = reference(case)
    assert _moved(want[:1])
    for t, grads in enumerate(GRADS):
        updates, state = step(state, _put(grads, mesh), jnp.asarray(True))
        if t % 2 == 0:
            assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
        else:
            w = want[t // 2]
            _assert_trees_equal(updates, jax.tree.map(lambda u: -LR * u, w), rtol=1e-5, atol=1e-7)


def _exact_grads(seed):
    """Per-worker gradients exact in bfloat16 with exact sums: small integers times a power of
    two per worker (so a TopK threshold or a quantization level cannot fall between the
    bfloat16 and float32 values of one number)."""
    rng = np.random.default_rng(seed)
    scales = np.asarray([1.0, 0.5, 0.25, 2.0], np.float32)[:W]
    return {
        k: scales.reshape(-1, *([1] * v.ndim))
        * rng.integers(-7, 8, (1, *v.shape)).astype(np.float32)
        for k, v in PARAMS.items()
    }


EXACT = [_exact_grads(10 + i) for i in range(3)]


def _warmup_branch(report):
    """The bytes of ``w``'s dense warm-up round in a step's collective ``report`` (its only
    ``[8,6]`` collective: the compressed rounds send payloads), a branch the psum case's steps
    after the warm-up do not take, at the width the backend sends the dtype (a ``bfloat16`` psum
    crosses as ``float32`` on the CPU backend, a ``float16`` one as itself)."""
    return sum(r.total_bytes for r in report.records if "[8,6]" in r.shape)


@pytest.fixture(scope="module")
def float32_exact(mesh, reference):
    """Each case's float32 run on :data:`EXACT` (updates, the state after each step) and its
    step 1's unmetered bytes (``None`` without a byte count): the reference of both 16-bit
    dtypes, computed once."""
    cache = {}

    def get(case):
        if case.name not in cache:
            step = reference(case, step=True)[1]  # the same program on other gradients
            want, states, step = _run(case, case.build(), mesh, EXACT, every_state=True, step=step)
            unmetered = None
            if hasattr(states[0], "bytes_sent"):
                unmetered = _unmetered(case, step, states[0], _put(EXACT[1], mesh))
            cache[case.name] = want, unmetered
        return cache[case.name]

    return get


def _unmetered(case, compiled, state, grads):
    """Compiled collective bytes less the state's ``bytes_sent``: what the meter counts that
    this step does not send, i.e. the collectives of the branches not taken (the HLO meter
    counts every branch of a ``cond``: Accordion's other mode, the same at every dtype), less
    the psum case's warm-up round (:func:`_warmup_branch`: its width is the dtype's)."""
    report = comm.collective_report(compiled.as_text())
    warmup = _warmup_branch(report) if "warmup_steps" in case.kwargs else 0
    assert ("warmup_steps" in case.kwargs) == (warmup > 0), warmup
    return report.total_bytes - warmup - float(compiled(state, grads)[1].bytes_sent)


@pytest.mark.parametrize(
    "dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)]
)  # float16 in the fast tier: tests/train/test_precision.py's data-parallel and AB runs
@pytest.mark.parametrize("case", _params(BF16_CASES))
def test_16_bit_params(case, dtype, mesh, float32_exact):
    """bfloat16 / float16 parameters and gradients: updates of that dtype, state types kept
    step to step, the float32 run's numbers on the same (16-bit-exact) gradients to bfloat16
    precision, and ``bytes_sent`` what crosses the compiled collectives (a ``bfloat16`` psum
    crosses as ``float32`` on the CPU backend: counted so)."""
    want, ref = float32_exact(case)
    assert _moved(want[:1])
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    tx = case.build()
    state = comm.place_state(_init(case, tx, params, mesh), mesh, AXIS)
    types = jax.tree.map(jax.typeof, state)
    exact = [_put(jax.tree.map(lambda g: g.astype(dtype), grads), mesh) for grads in EXACT]
    step = _runner(tx, state, mesh, exact[0])
    for i, (grads, w) in enumerate(zip(exact, want)):
        if i == 1 and hasattr(state, "bytes_sent"):  # after the psum case's warm-up round
            got = _unmetered(case, step, state, grads)
            assert ref is not None  # the float32 state's, after step 0
            assert got == ref and (ref == 0) == ("accordion" not in case.name), (got, ref)
        updates, state = step(state, grads)
        assert jax.tree.map(jax.typeof, state) == types
        assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(dtype)}
        scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(w))
        _assert_trees_equal(updates, w, rtol=2e-2, atol=1e-2 * scale)


# ---- ab_training: an optimizer alias over grouped workers -------------------------------------
# Its parameters and state are one entry per group of a (group, member) mesh (as
# parallel.ab_data_parallel lays them out: the members of a group agree), it needs params in
# update, and it applies the learning rate itself, so it is the last transform of a chain.

AB_OPTIONS = {"warmup_steps": 1, "sync_every": 3, "full_rank_steps": 1, "low_rank_cutoff": 0.05}
AB_LR = 0.05
AB_PARAMS = {
    "w": jnp.asarray(np.random.default_rng(5).standard_normal((8, 6)) * 0.3, jnp.float32),
    "b": jnp.zeros((6,)),
}
AB_WORKERS = (comm.GROUP, comm.MEMBER)
# dense (warm-up), ab (the first: exact factorisation), ab_then_sync, dense_then_refactor, ab
AB_KINDS = ("dense", "ab", "ab_then_sync", "dense_then_refactor", "ab")


@pytest.fixture(scope="module")
def ab_mesh():
    return parallel.ab_mesh(2, jax.devices()[:W])


def _ab_grads(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.standard_normal((W, *v.shape)), jnp.float32)
            for k, v in AB_PARAMS.items()}  # fmt: skip


AB_GRADS = [_ab_grads(20 + t) for t in range(len(AB_KINDS))]


def _ab_held(mesh):
    return transforms.ABConfig(AB_LR, **AB_OPTIONS).state_axes(mesh)


@functools.cache
def _ab_step(tx, mesh):
    """The jitted per-worker step of ``tx``: one program per transform object, whatever the
    gradients (a closure per run compiled the reference's program again for each)."""
    held = _ab_held(mesh)

    def body(params, state, grads):
        params, state = _local((params, state))
        updates, state = tx.update(_local(grads), state, params)
        new = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], (new, updates, state))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(held), P(held), P(AB_WORKERS)),
                                 out_specs=(P(held), P(held), P(held))))  # fmt: skip


def _ab_run(tx, mesh, grads_seq, state=None):
    """Updates of ``tx`` on each per-worker gradient (params move by them), and the state."""
    state = tx.init(AB_PARAMS) if state is None else state  # outside shard_map
    params, state = parallel.stack_per_worker((AB_PARAMS, state), mesh, _ab_held(mesh))
    step = _ab_step(tx, mesh)
    out = []
    for grads in grads_seq:
        grads = jax.device_put(grads, NamedSharding(mesh, P(AB_WORKERS)))
        params, updates, state = step(params, state, grads)
        out.append(jax.tree.map(np.asarray, updates))
    return out, state


@pytest.fixture(scope="module")
def ab_tx():
    """The reference transform (one object: its program is compiled once, ``_ab_step``)."""
    return transforms.ab_training(AB_LR, **AB_OPTIONS)


@pytest.fixture(scope="module")
def ab_reference(ab_mesh, ab_tx):
    return _ab_run(ab_tx, ab_mesh, AB_GRADS)[0]


def test_ab_steps_cover_every_kind_and_move_the_parameters(ab_reference):
    names = ("warmup_steps", "sync_every", "full_rank_steps")
    schedule = transforms.ABSchedule(*(AB_OPTIONS[k] for k in names))
    assert tuple(schedule.step_kind(t) for t in range(len(AB_KINDS))) == AB_KINDS
    assert _moved(ab_reference)


def test_ab_init_outside_shard_map_is_abstractly_stable(ab_mesh):
    tx = transforms.ab_training(AB_LR, **AB_OPTIONS)
    state = tx.init(AB_PARAMS)
    assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, jax.jit(tx.init)(AB_PARAMS))
    placed = parallel.stack_per_worker(state, ab_mesh, _ab_held(ab_mesh))
    assert jax.tree.structure(placed) == jax.tree.structure(state)


def _ab_with_options(learning_rate):  # ab_training's options are keyword-only (**options)
    return transforms.ab_training(learning_rate, **AB_OPTIONS)


def test_ab_injected_last_in_an_optax_chain_under_cond(ab_mesh, ab_reference):
    """``chain(identity, scale(0.5), inject_hyperparams(ab_training))`` inside ``lax.cond``
    (predicate uniform), one program: on twice the gradients the reference's numbers (exact:
    0.5 is a power of two) at each step kind, the new state of the old state's types; ``False``
    zero updates and the state as it was; a learning rate set in the injected state is the
    rate used (== ab_training built with it, the same program run on the changed state)."""
    tx = optax.chain(
        optax.identity(), optax.scale(0.5), optax.inject_hyperparams(_ab_with_options)(AB_LR)
    )
    held = _ab_held(ab_mesh)
    seen = []

    def body(params, state, grads, pred):
        params, state = _local((params, state))
        grads = _local(grads)

        def run(s):
            updates, new = tx.update(grads, s, params)
            seen.append(jax.tree.map(jax.typeof, s) == jax.tree.map(jax.typeof, new))
            return updates, new

        def skip(s):
            return jax.tree.map(jnp.zeros_like, params), s

        updates, state = lax.cond(pred, run, skip, state)
        new = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], (new, updates, state))

    specs = (P(held), P(held), P(AB_WORKERS), P())
    step = jax.jit(jax.shard_map(body, mesh=ab_mesh, in_specs=specs,
                                 out_specs=(P(held), P(held), P(held))))  # fmt: skip
    doubled = [jax.tree.map(lambda g: np.asarray(g) * np.float32(2), g) for g in AB_GRADS]

    def run(state, check_skip=False):
        params, state = parallel.stack_per_worker((AB_PARAMS, state), ab_mesh, held)
        out = []
        for grads in doubled:
            grads = jax.device_put(grads, NamedSharding(ab_mesh, P(AB_WORKERS)))
            if check_skip:
                _, zeros, same = step(params, state, grads, jnp.asarray(False))
                assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(zeros))
                _assert_trees_equal(jax.tree.map(np.asarray, same), jax.tree.map(np.asarray, state))
            params, updates, state = step(params, state, grads, jnp.asarray(True))
            out.append(jax.tree.map(np.asarray, updates))
        return out

    state = tx.init(AB_PARAMS)  # outside shard_map
    assert set(state[2].hyperparams) == {"learning_rate"}
    for g, w in zip(run(state, check_skip=True), ab_reference, strict=True):
        _assert_trees_equal(g, w, rtol=1e-6, atol=1e-7)
    assert seen and all(seen)
    state[2].hyperparams["learning_rate"] = jnp.asarray(2 * AB_LR, jnp.float32)
    want, _ = _ab_run(transforms.ab_training(2 * AB_LR, **AB_OPTIONS), ab_mesh, AB_GRADS)
    assert not np.allclose(want[0]["w"], ab_reference[0]["w"])
    for g, w in zip(run(state), want, strict=True):
        _assert_trees_equal(g, w, rtol=1e-6, atol=1e-7)
