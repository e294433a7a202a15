"""AB-Training in a grouped data-parallel loop: truncation, capacity, checkpoints, errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _driver
from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab._schedule import STEP_KINDS

SPECTRUM = np.array([2.0, 1.0, 0.1, 0.05, 0.02, 0.01], np.float32)  # cutoff 0.15 keeps 2


def init_params():
    q1, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((8, 6)))
    q2, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((6, 6)))
    kernel = (q1 * SPECTRUM) @ q2.T
    return {
        "l1": {"kernel": jnp.asarray(kernel, jnp.float32), "bias": jnp.zeros(6)},
        "head": {"kernel": jnp.full((6, 2), 0.3), "bias": jnp.zeros(2)},
    }


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)


def batches(steps):
    rng = np.random.default_rng(2)
    return [(rng.standard_normal((8, 8), np.float32), rng.standard_normal((8, 2), np.float32))
            for _ in range(steps)]  # fmt: skip


# phases: steps 0-1 warm-up, 2-3 AB (untruncated), 4 full rank + re-factorisation, 5-7 AB, ...
TX_KWARGS = dict(warmup_steps=2, sync_every=4, full_rank_steps=1, exclude=("head",))


@pytest.fixture(scope="module")
def grouped():
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    config = transforms.ABConfig(1e-3, **TX_KWARGS)
    return config, parallel.ab_data_parallel(loss_fn, config, mesh, donate=False)


# The marked test and the fusion counts first, optimised; the rest compile unoptimised
# (``fast_compiles``: ranks, bytes, errors, runs compared with runs of the same programs or to
# a tolerance), and that fixture stays on to the module's end once a test asks for it.
FAST = pytest.mark.usefixtures("fast_compiles")


@pytest.mark.user_numerics
def test_the_refactorisation_compiles_fast_wherever_it_compiles_with_the_default_bits(grouped):
    """The re-factorisation (a few calls a run) compiles at XLA:CPU's backend level 0, the
    steps at the default: the options travel with the program (``compile_all`` and a compile
    on first use alike), and the refactored state is the default level's bit for bit."""
    from jaxcomp import _cpu
    from jaxcomp.ab import _programs

    config, dp = grouped
    state = dp.init(init_params())
    batch = dp.shard_batch(batches(1)[0])
    programs = _programs.Programs(config, loss_fn, dp.mesh, donate=False)
    state = programs.run("dense", state, batch)[0]
    args = programs._args("refactor", state)
    assert programs._program("dense").compiler_options is None
    assert programs._program("ab").compiler_options is None
    lowered = programs._program("refactor").lower(*args)
    assert lowered.options == _cpu.RARELY_RUN_OPTIONS
    fast = programs.compiled("refactor", *args)  # compiled on first use
    default = lowered.lowered.compile()
    got, want = fast(*args), default(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _fusions(programs, name, state, batch):
    args = programs._args(name, state, batch)
    return programs.compiled(name, *args).as_text().count(" fusion(")


@pytest.mark.parametrize("name", ["dense", "ab"])
def test_the_finiteness_check_reads_what_a_program_writes_without_computing_it_again(grouped, name):
    # XLA:CPU fused each written leaf's producer into the check's concatenation too: a
    # kernel more per leaf (compile time follows the kernels; main: dense 32 -> 43). The
    # check in a cond reads them once; it adds its own few kernels (the flag, the sum, the
    # finiteness). Not the transition program yet: XLA moves the stacking reshape into the
    # cond there and computes the aligned moments twice again (21 -> 33).
    from jaxcomp.ab import _programs

    config, dp = grouped
    state, batch = dp.init(init_params()), dp.shard_batch(batches(1)[0])
    count = {
        check: _fusions(
            _programs.Programs(config, loss_fn, dp.mesh, donate=False, check_finite=check),
            name, state, batch,
        )
        for check in (False, True)
    }  # fmt: skip
    assert count[True] - count[False] <= 4, count


@pytest.mark.slow
@FAST
def test_truncation_cuts_the_rank_and_capacity_can_follow(grouped):
    _, dp = grouped
    params, data = init_params(), batches(8)
    state = dp.init(params)
    for batch in data[:5]:
        state, _ = dp.step(state, batch)
    metrics = transforms.ab_metrics(state.opt_state, state.params)
    assert int(metrics["phase"]) == transforms.ABPhase.AB
    np.testing.assert_array_equal(metrics["rank"], [2])
    by_layer = transforms.ab_metrics(state.opt_state, state.params, exclude=("head",))
    assert {k: int(v) for k, v in by_layer["rank_by_layer"].items()} == {"l1/kernel": 2}
    with pytest.raises(ValueError, match="does not give this state's factorised layers"):
        transforms.ab_metrics(state.opt_state, state.params, exclude=())
    # 68 parameters, the (8, 6) kernel now trains as 2 * (8 + 6) = 28: 68 / 48
    np.testing.assert_allclose(metrics["compression_ratio"], 68 / 48, rtol=1e-6)
    kernel = parallel.worker_entry(state.params)["l1"]["kernel"]
    assert np.sum(np.linalg.svd(kernel, compute_uv=False) > 1e-5) == 2
    opt = state.opt_state  # factors and their moments beyond the rank are zero
    for x in (opt.a[0], opt.a_state.mu[0], opt.a_state.nu[0]):
        np.testing.assert_array_equal(np.asarray(x)[..., 2:], 0.0)
    for x in (opt.b[0], opt.b_state.mu[0], opt.b_state.nu[0]):
        np.testing.assert_array_equal(np.asarray(x)[:, 2:], 0.0)

    fitted = state._replace(opt_state=parallel.fit_rank_capacity(state.opt_state))
    assert [x.shape for x in fitted.opt_state.a] == [(2, 8, 2)]  # one entry per group
    assert [x.shape for x in fitted.opt_state.a_state.mu] == [(2, 8, 2)]
    for batch in data[5:8]:  # the same AB steps at capacity 6 and at capacity 2
        state, _ = dp.step(state, batch)
        fitted, _ = dp.step(fitted, batch)
    for got, want in zip(jax.tree.leaves(fitted.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)

    full = parallel.fit_rank_capacity(fitted.opt_state, "full")
    assert [x.shape for x in full.b] == [(2, 6, 6)]
    np.testing.assert_array_equal(np.asarray(full.b[0])[:, 2:], 0.0)


@FAST
def test_a_multi_device_cpu_harness_runs_openblas_on_one_thread(grouped):
    """Several CPU devices in one process call LAPACK at once; multi-threaded OpenBLAS then
    stalls their collectives (see ``tests/train/test_ab_contention.py``)."""
    import threadpoolctl

    blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    assert blas and all(i["num_threads"] == 1 for i in blas), blas


@FAST
def test_capacity_sets_the_bytes_on_the_wire(grouped):
    config, dp = grouped
    params = init_params()
    small = parallel.fit_rank_capacity(transforms.ab_training(**_fields(config)).init(params),
                                         [2])  # fmt: skip
    full, cut = (
        transforms.ab_step_bytes(params, dp.mesh, config, state=s, kinds=("ab",))["ab"][
            "a"
        ].total_bytes
        for s in (None, small)
    )
    assert full - cut == compressors.wire_bytes(jnp.zeros((8, 6 - 2)))


def _fields(config):
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@FAST
def test_a_checkpoint_mid_ab_phase_restores_and_continues_identically(grouped, tmp_path):
    _, dp = grouped
    params, data = init_params(), batches(8)
    state = dp.init(params)
    for batch in data[:3]:  # stop after the first AB step
        state, _ = dp.step(state, batch)
    assert int(transforms.ab_metrics(state.opt_state, state.params)["phase"]) == 1
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        mngr.save(3, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, dp.state_sharding(params),
    )  # fmt: skip
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(target))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for batch in data[3:8]:  # AB, sync, full rank + re-factorisation, AB
        state, m1 = dp.step(state, batch)
        restored, m2 = dp.step(restored, batch)
        assert float(m1["loss"]) == float(m2["loss"])
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@FAST
def test_the_step_reports_each_workers_bytes_by_role_and_the_dense_bytes(grouped):
    config, dp = grouped
    state, data = dp.init(init_params()), batches(8)
    kinds = dp.step_bytes(state, data[0])
    refactor = kinds["dense_then_refactor"]["all"] - kinds["dense"]["all"]
    dense = 4 * (8 * 6 + 6 + 6 * 2 + 2)  # the float32 gradient
    for t, batch in enumerate(data):
        state, metrics = dp.step(state, batch)
        kind = config.schedule.step_kind(t)
        want = [kinds[kind]["all"]] * 4 if kind.startswith("dense") else [kinds[kind]["a"]] * 2 + [
            kinds[kind]["b"]] * 2  # the first group trains A  # fmt: skip
        if t == config.warmup_steps:  # the factorisation runs before the first AB step
            want = [w + refactor for w in want]
        assert metrics["bytes_sent"].tolist() == want, (t, kind)
        assert metrics["dense_bytes"].tolist() == [dense] * 4
        assert metrics["rank"].shape == (2, 1)  # one entry per group, one factorised kernel
    # a dense step sends the gradient and the loss's mean (one float32)
    assert kinds["dense"]["all"] == dense + 4
    assert refactor > 0 and kinds["ab"]["b"] < kinds["ab"]["a"] < kinds["ab_then_sync"]["b"]


@FAST
def test_a_loss_scale_is_undone_exactly_and_a_missing_one_is_an_error(grouped):
    # float16 compute's loss scale: the gradients of loss * 2**10, divided by 2**10, are the
    # plain gradients bit for bit (powers of two), through every program of a cycle
    config, plain = grouped
    scaled = parallel.ab_data_parallel(loss_fn, config, plain.mesh, donate=False,
                                       loss_scaling=True)  # fmt: skip
    a = plain.init(init_params())
    b = scaled.init(init_params())
    for batch in batches(5):  # dense, dense, factorise + AB, AB + sync, dense + refactor
        a, ma = plain.step(a, batch)
        b, mb = scaled.step(b, batch, 2.0**10)
        assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="needs a loss_scale"):
        scaled.step(b, batch)
    with pytest.raises(ValueError, match="built without loss_scaling"):
        plain.step(a, batch, 1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(low_rank_cutoff=0.0), "low_rank_cutoff must be in"),
        (dict(low_rank_cutoff=1.0), "low_rank_cutoff must be in"),
        (dict(low_rank_cutoff=float("nan")), "low_rank_cutoff must be in"),
        (dict(sync_mode="stale"), "sync_mode must be one of"),
        (dict(comm_setup="ring"), "comm_setup must be one of"),
        (dict(dense_sync="mean"), "dense_sync must be None or one of"),
        (dict(max_rank=0), "max_rank must be None or an integer >= 1"),
        (dict(max_rank=0.5), "max_rank must be None or an integer >= 1"),
        (dict(max_rank_fraction=0.0), r"max_rank_fraction must be None or in \(0, 1\]"),
        (dict(max_rank_fraction=2), r"max_rank_fraction must be None or in \(0, 1\]"),
        (dict(full_rank_steps=4), "full_rank_steps must be <"),
        (dict(warmup_steps=2.0), "warmup_steps must be an int"),
        (dict(exclude="head"), "exclude must be a sequence"),
        (dict(inner=0.9), "inner must be an optax GradientTransformation"),
        (dict(learning_rate=-1.0), "learning_rate must be"),
        (dict(learning_rate=float("nan")), "learning_rate must be"),
        (dict(learning_rate=jnp.asarray(-1.0)), "learning_rate must be finite and >= 0"),
        (dict(learning_rate=jnp.asarray(jnp.nan)), "learning_rate must be finite and >= 0"),
        (dict(learning_rate=jnp.asarray(jnp.inf)), "learning_rate must be finite and >= 0"),
        (dict(learning_rate=jnp.ones(2)), r"learning_rate must be a scalar; got .* shape \(2,\)"),
        (dict(learning_rate=jnp.asarray(True)), "learning_rate must be a scalar; got .* bool"),
        (dict(lr_rebound_steps=-2), "lr_rebound_steps must be an integer >= 0"),
        (dict(lr_rebound_floor=0.0), "lr_rebound_floor must be a number > 0"),
        (dict(max_grad_norm="1"), "max_grad_norm must be None or a number > 0"),
        (dict(reset_opt=1), "reset_opt must be a bool"),
        (dict(axis_name=("group", "group")), "axis_name has a repeated axis"),
        (dict(axis_name=3), "axis_name must be a mesh axis name"),
        (dict(group_size=0), "group_size must be None or an integer >= 1"),
        (dict(group_size=2, num_groups=2), "give group_size or num_groups, not both"),
        (dict(sync_every=True), "sync_every must be an integer >= 2"),
        (dict(num_groups=np.float32(2)), "num_groups must be None or an integer >= 1"),
    ],
)
@FAST
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        transforms.ABConfig(**{"learning_rate": 1e-3, **TX_KWARGS, **kwargs})
    with pytest.raises(ValueError, match=match):
        transforms.ab_training(**{"learning_rate": 1e-3, **TX_KWARGS, **kwargs})


@FAST
def test_numpy_integers_are_taken_and_stored_as_python_ints():
    config = transforms.ABConfig(1e-3, **{**TX_KWARGS, "warmup_steps": np.int64(2)},
                                 max_rank=np.int32(3), num_groups=np.int64(2))  # fmt: skip
    values = (config.warmup_steps, config.max_rank, config.num_groups, config.schedule.sync_every)
    assert values == (2, 3, 2, 4) and all(type(v) is int for v in values)


@FAST
def test_group_count_must_divide_the_data_axis():
    with pytest.raises(ValueError, match="num_groups=3 does not divide the data axis of 8"):
        parallel.ab_mesh(3, jax.devices()[:8])
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        parallel.ab_mesh(0, jax.devices()[:8])


@FAST
def test_groupings_the_workers_cannot_form_are_errors_naming_the_problem():
    flat = comm.make_mesh([("data", 4)], jax.devices()[:4])
    too_big = transforms.ABConfig(1e-3, **TX_KWARGS, axis_name="data", group_size=5)
    with pytest.raises(ValueError, match="group_size=5 is larger than the 4 workers"):
        parallel.ab_data_parallel(loss_fn, too_big, flat)
    typo = transforms.ABConfig(1e-3, **TX_KWARGS, axis_name=("groups", "member"))
    with pytest.raises(ValueError, match=r"has no axis \['groups'\]"):
        parallel.ab_data_parallel(loss_fn, typo, parallel.ab_mesh(2, jax.devices()[:4]))
    with pytest.raises(ValueError, match="needs an ABConfig"):
        parallel.ab_data_parallel(loss_fn, transforms.ab_training(1e-3, **TX_KWARGS), flat)


@FAST
def test_excluded_name_matching_nothing_raises_at_init():
    tx = transforms.ab_training(1e-3, **{**TX_KWARGS, "exclude": ("classifier",)})
    with pytest.raises(ValueError, match=r"exclude: \['classifier'\] match no parameter"):
        tx.init(init_params())


@FAST
def test_update_outside_shard_map_or_with_other_params_raises():
    tx = transforms.ab_training(1e-3, **TX_KWARGS)
    params = init_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match="inside shard_map over a mesh with the axes"):
        tx.update(params, state, params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state)
    wider = {**params, "l1": {"kernel": jnp.zeros((8, 7)), "bias": jnp.zeros(7)}}
    with pytest.raises(ValueError, match=r"l1/kernel has shape \(8, 7\).*state's factors are 8x6"):
        tx.update(wider, state, wider)
    bad_grads = {**params, "head": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(2)}}
    with pytest.raises(ValueError, match=r"gradient of head/kernel has shape \(6, 3\)"):
        tx.update(bad_grads, state, params)


@FAST
def test_a_state_off_the_mesh_is_an_error_naming_it(grouped):
    _, dp = grouped
    state = dp.init(init_params())
    host = jax.tree.map(np.asarray, state)  # e.g. restored without state_sharding
    with pytest.raises(ValueError, match="must live on the mesh"):
        dp.step(host, batches(1)[0])


def _stateful_loss(params, model_state, batch):
    """``loss_fn`` with a running state each worker updates from its own shard."""
    x, _ = batch
    return loss_fn(params, batch), {"m": 0.5 * model_state["m"] + 0.5 * x.mean(0)[:2]}


def _model_state_follows_the_dense_sync_rule(config, history, data):
    """Steps 2 and 3 (AB, then AB + sync) of a run of ``_stateful_loss``: each worker updates
    its own running state from its own rows, and the sync applies ``config``'s dense rule."""
    assert [config.schedule.step_kind(t) for t in range(4)][-1] == "ab_then_sync"
    before = history[2][0].model_state["m"]
    assert before.shape == (4, 2) and not np.allclose(before[0], before[1])  # each its own
    own = 0.5 * before + 0.5 * data[3][0].reshape(4, 2, 8).mean(1)[:, :2]  # 2 rows per worker
    state, metrics = history[3]
    want = {"average": own.mean(0), "first": own[0], "keep": own}[config.dense_sync]
    np.testing.assert_allclose(state.model_state["m"], np.broadcast_to(want, own.shape),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    assert int(np.min(metrics["finite"])) == 1


@functools.cache
def _flat_stateful():
    """Groups of 2 on a flat axis, ``only-learned``, with a model state averaged at a sync:
    the harness of the model-state test, whose programs the sync-bytes test measures."""
    mesh = comm.make_mesh([("data", 4)], jax.devices()[:4])
    config = transforms.ABConfig(1e-3, **TX_KWARGS, dense_sync="average", axis_name="data",
                                 group_size=2, sync_mode="only-learned")  # fmt: skip
    return config, parallel.ab_data_parallel(_stateful_loss, config, mesh, has_state=True,
                                             donate=False)  # fmt: skip


@pytest.mark.slow
@FAST
def test_a_model_state_is_per_worker_and_follows_the_dense_sync_rule():
    # groups of 2 on a flat axis; the rules on other layouts ride on the donation test's runs
    # (rectangular average and keep, flat first with groups of 3 + 1)
    config, dp = _flat_stateful()
    state = dp.init(init_params(), {"m": jnp.zeros(2)})
    data, history = batches(4), []
    for batch in data:
        state, metrics = dp.step(state, batch)
        history.append(jax.tree.map(np.asarray, (state, metrics)))
    _model_state_follows_the_dense_sync_rule(config, history, data)
    assert dp.abstract_state(init_params(), {"m": jnp.zeros(2)}).model_state["m"].shape == (4, 2)


@FAST
def test_a_model_state_needs_has_state(grouped):
    _, dp = grouped
    with pytest.raises(ValueError, match="without has_state"):
        dp.init(init_params(), {"m": jnp.zeros(2)})


def _mesh_of(layout):
    """4 workers: a flat ``data`` axis, or 2 groups of 2 (``ab_mesh``)."""
    if layout == "flat":
        return comm.make_mesh([("data", 4)], jax.devices()[:4])
    return parallel.ab_mesh(2, jax.devices()[:4])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,options",
    [
        ("rectangular", dict(reset_opt=True, dense_sync="average")),  # transitions zero moments
        ("flat", dict(axis_name="data", group_size=3, sync_mode="only-learned",
                      dense_sync="first")),  # 3 + 1
        ("rectangular", dict(comm_setup="individual", lr_rebound_steps=2, dense_sync="keep")),
    ],
)  # fmt: skip
@FAST
def test_without_donation_the_programs_return_only_what_they_write(layout, options):
    # donate=False (the trainer's, which keeps the previous state on a non-finite step) has
    # each program return only the leaves it wrote and the host put back the rest: over
    # every step kind (warm-up, factorisation, AB, sync, full rank, re-factorisation) the
    # states, model states and metrics must equal the donating harness's bit for bit; the
    # runs also show the model state's dense_sync rule at the first sync
    mesh = _mesh_of(layout)
    config = transforms.ABConfig(1e-3, **TX_KWARGS, **options)
    assert {config.schedule.step_kind(t) for t in range(10)} == set(STEP_KINDS)
    runs, data = {}, batches(10)
    for donate in (True, False):
        dp = parallel.ab_data_parallel(_stateful_loss, config, mesh, has_state=True, donate=donate)
        state = dp.init(init_params(), {"m": jnp.zeros(2)})
        history = []
        for batch in data:
            old, saved = state, jax.tree.map(np.asarray, state)
            state, metrics = dp.step(state, batch)
            history.append(jax.tree.map(np.asarray, (state, metrics)))
            if not donate:  # the previous state is intact, to fall back on
                jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, old), saved)
        runs[donate] = history
    for got, want in zip(runs[False], runs[True]):
        jax.tree.map(np.testing.assert_array_equal, got, want)
    _model_state_follows_the_dense_sync_rule(config, runs[False], data)


@FAST
def test_a_sync_that_overflows_is_reported_even_when_the_ab_step_was_finite(grouped):
    # each group's own product A_g B_g is moderate, the synced product of the means is not:
    # group 0 holds (1e25 A, 1e-25 B), group 1 (1e-25 A, 1e25 B), so mean(A) mean(B) ~ 0.25e50
    # A B = inf in float32. The AB program's own flags are 1; the sync's must reach metrics.
    config, dp = grouped
    state, data = dp.init(init_params()), batches(4)
    assert config.schedule.step_kind(3) == "ab_then_sync"
    for batch in data[:3]:
        state, _ = dp.step(state, batch)

    def scaled(factors, per_group):
        scale = np.asarray(per_group, np.float32)[:, None, None]
        return tuple(jax.device_put(np.asarray(x) * scale, x.sharding) for x in factors)

    opt = state.opt_state
    opt = opt._replace(a=scaled(opt.a, [1e25, 1e-25]), b=scaled(opt.b, [1e-25, 1e25]))
    state, metrics = dp.step(state._replace(opt_state=opt), data[3])
    assert not np.isfinite(np.asarray(state.params["l1"]["kernel"])).all()  # the case is real
    finite = np.asarray(metrics["finite"])
    assert finite.shape == (2,) and finite.tolist() == [0, 0]


@FAST
def test_a_program_compiles_again_for_another_dtype_or_weak_type():
    # the compile cache's key: an argument of another dtype or weak type is another program
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    program = _driver.Program(lambda x: x * 2, mesh, lambda *_: (P(), P()), donate=False)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))  # noqa: E731
    f32, f16 = put(np.ones(3, np.float32)), put(np.ones(3, np.float16))
    weak = put(jnp.asarray(1.0))  # a weakly typed float32 scalar
    strong = put(np.float32(1.0))
    assert program.compiled(f32) is program.compiled(put(np.zeros(3, np.float32)))
    assert program.compiled(f32) is not program.compiled(f16)
    assert program.compiled(weak) is not program.compiled(strong)
    assert program(f16).dtype == np.float16 and program(weak).weak_type


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rectangular", "flat"])
@FAST
def test_the_sync_inside_the_ab_program_counts_at_the_sync_kind_only(grouped, layout):
    # the harness runs a cycle's last AB step and its sync as one program (a cond on a flag):
    # the sync's collectives must add to that kind's bytes exactly what they add to the optax
    # transform's (and the model state's mean), and nothing to a plain AB step's; the
    # harnesses' step programs, compiled by the tests before, measured
    if layout == "flat":  # groups of 2, only-learned, a model state of 2 float32
        config, dp = _flat_stateful()
        state, model_state = dp.init(init_params(), {"m": jnp.zeros(2)}), 4 * 2
    else:
        (config, dp), model_state = grouped, 0
        state = dp.init(init_params())
    params, mesh = init_params(), dp.mesh
    harness = dp.step_bytes(state, batches(1)[0])
    kinds = ("ab", "ab_then_sync")
    optax_ = transforms.ab_step_bytes(params, mesh, config, kinds=kinds)
    for role in ("a", "b"):
        sync = harness["ab_then_sync"][role] - harness["ab"][role]
        want = optax_["ab_then_sync"][role].total_bytes - optax_["ab"][role].total_bytes
        assert sync == want + model_state and want > 0
    # the plain AB step's bytes are the optax transform's plus the loss's pmean (a scalar)
    for role in ("a", "b"):
        assert 0 < harness["ab"][role] - optax_["ab"][role].total_bytes <= 8
