"""accordion: the detector against the reference rule, switching, HLO bytes per mode, orbax."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.comm import _hlo
from jaxcomp.transforms import HIGH_COMPRESSION as HIGH
from jaxcomp.transforms import LOW_COMPRESSION as LOW

pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
PARAMS = {"a": jnp.zeros((16, 16)), "b": jnp.zeros((16, 8)), "bias": jnp.zeros((8,))}
DIRECTIONS = {
    k: np.random.default_rng(i).standard_normal(v.shape).astype(np.float32)
    for i, (k, v) in enumerate(PARAMS.items())
}


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def reference_modes(norms, lrs, check_every):
    """Modes used in each epoch, transcribed from Accordion's main.py + auto_scale.py."""
    num_leaves = len(norms[0])
    mode = [LOW] * num_leaves  # start_k: the first epoch at low compression
    grad_calc, used = {}, []
    for epoch, current in enumerate(norms):
        used.append(list(mode))
        grad_calc[epoch] = current
        if epoch % check_every == 0:  # run_auto_scale_gng
            old = None if epoch == 0 else grad_calc[epoch - check_every]
            new_mode = []
            for i, new in enumerate(current):
                if epoch == 0:
                    new_mode.append(LOW)
                    continue
                ratio = abs(old[i] - new) / old[i] if old[i] != 0.0 else 9
                new_mode.append(HIGH if ratio < 0.5 else LOW)
            mode = new_mode
        if epoch + 1 < len(lrs) and lrs[epoch + 1] < lrs[epoch]:  # decay: all high rank
            mode = [LOW] * num_leaves
    return used


def test_switches_exactly_as_the_reference_on_scripted_norms_and_lrs():
    steps = 2
    scale_a = [1.0, 5.0, 1.2, 0.1, 0.5, 0.2, 0.55, 0.6, 0.59, 3.0, 0.1, 0.1]
    scale_b = [2.0, 2.0, 0.9, 0.9, 0.0, 1.0, 0.25, 0.2, 0.26, 0.26, 0.27, 0.5]
    lrs = [0.1] * 5 + [0.01] * 4 + [0.001] * 3
    schedule = lambda count: jnp.asarray(lrs)[jnp.minimum(count // steps, len(lrs) - 1)]
    tx = transforms.accordion(
        interval_steps=steps, check_every=2, learning_rate=schedule, axis_name=None
    )
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    used = []
    for epoch in range(len(lrs)):
        for step in range(steps):
            grads = {
                "a": scale_a[epoch] * DIRECTIONS["a"],
                "b": scale_b[epoch] * DIRECTIONS["b"],
                "bias": DIRECTIONS["bias"],
            }
            _, state = update(grads, state)
            modes = transforms.accordion_metrics(state)["modes"]
            if step == 0:  # after the first step of an epoch: the mode that epoch uses
                used.append([int(modes["a"]), int(modes["b"])])
            assert int(modes["bias"]) == transforms.UNCOMPRESSED
    norms = [
        [steps * a * np.linalg.norm(DIRECTIONS["a"]), steps * b * np.linalg.norm(DIRECTIONS["b"])]
        for a, b in zip(scale_a, scale_b)
    ]
    expected = reference_modes(norms, lrs, check_every=2)
    assert used == expected
    assert {HIGH, LOW} <= {m for row in expected for m in row}  # the script exercises both


def sharded(tx, mesh, params=PARAMS):
    state = tx.init(params)  # outside shard_map
    specs = comm.state_specs(state, comm.DATA)

    def body(state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        return updates, state, transforms.accordion_metrics(state)

    update = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=(P(), specs, P()))
    )
    return comm.place_state(state, mesh, comm.DATA), update


@pytest.mark.slow
@pytest.mark.parametrize(("statistic", "mode"), [("worker0", HIGH), ("mean", LOW)])
def test_decisions_are_replicated_from_the_chosen_statistic(mesh, statistic, mode):
    tx = transforms.accordion(interval_steps=2, check_every=1, statistic=statistic)
    state, update = sharded(tx, mesh)
    # worker 0's norm barely moves between intervals; the other workers' triple
    scales = [[1.0] * W, [1.1] + [3.0] * (W - 1)]
    for epoch in range(2):
        for _ in range(2):
            g = {k: np.stack([s * d for s in scales[epoch]]) for k, d in DIRECTIONS.items()}
            g = jax.device_put(g, NamedSharding(mesh, P(comm.DATA)))
            _, state, metrics = update(state, g)
    assert int(metrics["modes"]["a"]) == mode and int(metrics["modes"]["b"]) == mode


@pytest.mark.slow
def test_low_compression_mode_equals_compressed_mean_with_power_sgd(mesh):
    """Until its first switch, ``switching_dp``'s step (the payload and orbax tests' program:
    low compression, PowerSGD rank 2 with error feedback) == ``compressed_mean`` of that
    channel in the same chain."""
    params = {k: jnp.asarray(0.1 * d) for k, d in DIRECTIONS.items()}
    channel = feedback.error_feedback(compressors.power_sgd(2))
    tx = optax.chain(transforms.compressed_mean(channel), optax.sgd(1e-3, momentum=0.9))
    runs = []
    with jax.set_mesh(mesh):
        for dp in (switching_dp("power_sgd", mesh),
                   parallel.data_parallel(mlp_loss, tx, mesh, donate=False)):  # fmt: skip
            state = dp.init(params)
            for _ in range(3):
                state, _ = dp.step(state, BATCH)
            runs.append(state)
    modes = transforms.accordion_metrics(runs[0].opt_state)["modes"]  # low at all 3 steps
    assert int(modes["a"]) == LOW and int(modes["b"]) == LOW
    for k in params:
        got, want = np.asarray(runs[0].params[k]), np.asarray(runs[1].params[k])
        assert not np.allclose(want, params[k], rtol=0, atol=1e-6)  # the steps moved it
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# Wire bytes per mode, from the HLO of a data-parallel step


def conditional_branch_bytes(hlo_text):
    """For every ``conditional``: the collective bytes of each branch (with its callees)."""
    comps, _ = _hlo.computations(hlo_text)
    report = _hlo.collective_report(hlo_text)
    direct = {}
    for r in report.records:
        direct[r.computation] = direct.get(r.computation, 0.0) + r.bytes_per_execution

    def total(comp, depth=0):
        callees = [
            name
            for line in comps.get(comp, ())
            for _, target in _hlo._CALLEE.findall(line)
            for name in re.findall(r"%?([\w.\-]+)", target)
        ]
        return direct.get(comp, 0.0) + sum(total(c, depth + 1) for c in callees if depth < 32)

    out = []
    for lines in comps.values():
        for line in lines:
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m and " conditional(" in line:
                names = re.findall(r"%?([\w.\-]+)", m.group(1))
                out.append(tuple(total(n) for n in names))
    return out


def mlp_loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"] - y) ** 2) + jnp.sum(params["bias"])


BATCH = (
    np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32),
    np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32),
)


PAIRS = {
    "power_sgd": (compressors.power_sgd(2), compressors.power_sgd(1)),
    "top_k": (compressors.top_k(0.99), compressors.top_k(0.1)),
}


@functools.cache
def switching_dp(pair, mesh):
    """A data-parallel step whose next check goes high (small steps); PowerSGD's step program,
    under ``jax.set_mesh``, is shared by the low-compression, payload and orbax tests (one
    compile); TopK's payloads are checked without a mesh context."""
    tx = optax.chain(
        transforms.accordion(*PAIRS[pair], interval_steps=2, check_every=1),
        optax.sgd(1e-3, momentum=0.9),
    )
    return parallel.data_parallel(mlp_loss, tx, mesh, donate=False)


@pytest.mark.slow
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_each_mode_sends_exactly_its_payload(mesh, pair):
    low, high = PAIRS[pair]
    dp = switching_dp(pair, mesh)
    if pair == "power_sgd":  # under jax.set_mesh, as the orbax test runs the same program
        with jax.set_mesh(mesh):
            _check_payloads(dp, low, high)
    else:  # and without a mesh context
        _check_payloads(dp, low, high)


def _check_payloads(dp, low, high):
    state = dp.init({k: jnp.asarray(0.1 * d) for k, d in DIRECTIONS.items()})  # not all zero
    text = dp.step.lower(state, BATCH).compile().as_text()
    report = comm.collective_report(text)
    gradient_shape = re.compile(r"f32\[16,(16|8)\]")
    dense = [r for r in report.records if gradient_shape.search(r.shape)]
    if low.name.startswith("power_sgd"):  # no uncompressed gradient all-reduce anywhere
        assert not dense, report.table()

    def payload(codec, like):
        return comm.plan_reduce(codec, like).wire_bytes(like, W)

    expected = {
        (float(payload(high, PARAMS[k])), float(payload(low, PARAMS[k]))) for k in ("a", "b")
    }
    expected.add((0.0, 4.0 * 2))  # the regime statistic, at interval ends only
    assert set(conditional_branch_bytes(text)) == expected
    if low.name.startswith("top_k"):  # 99% TopK is not smaller than dense: dense pmean
        assert (4.0 * 16 * 16) in {lo for _, lo in expected}

    # the bytes_sent metric follows the mode actually used
    seen = set()
    for _ in range(6):
        state, _ = dp.step(state, BATCH)
        metrics = transforms.accordion_metrics(state.opt_state)
        modes = metrics["modes"]
        end = int(metrics["count"]) % 2 == 0
        want = 4.0 * 8 + (8.0 if end else 0.0)  # bias pmean (+ statistic)
        for k in ("a", "b"):
            hi, lo = payload(high, PARAMS[k]), payload(low, PARAMS[k])
            want += lo if int(modes[k]) == LOW else hi
        seen.update(int(m) for m in jax.tree.leaves(modes))
        if not end:  # at an interval end the mode may have changed after sending
            assert float(metrics["bytes_sent"]) == want
    assert seen == {LOW, HIGH, transforms.UNCOMPRESSED}  # both modes' bytes were checked


# ----------------------------------------------------------------------------------------------
# Checkpointing and composition


@pytest.mark.slow
def test_state_survives_orbax_and_the_run_continues_identically(mesh, tmp_path):
    """Under ``jax.set_mesh`` (the payload test's program), where a switch re-initialises the
    incoming PowerSGD Q inside the traced shard_map body: a staged computation, not an eager
    PRNG key (issue 14); the restored state continues bit for bit."""
    dp = switching_dp("power_sgd", mesh)  # the default codecs
    fresh = np.asarray(compressors.power_sgd(1).init(PARAMS["a"]).q)
    switched = []

    def run(state, n=4, modes=None):
        for _ in range(n):
            state, metrics = dp.step(state, BATCH)
            if modes is not None:
                modes.append(int(transforms.accordion_metrics(state.opt_state)["modes"]["a"]))
                if modes[-2:] == [LOW, HIGH]:  # switched at this interval end: Q restarted
                    high = state.opt_state[0].leaves["a"].high.q.q
                    np.testing.assert_array_equal(np.asarray(high), fresh)
                    switched.append(len(modes))
                assert np.isfinite(float(metrics["loss"]))
        return state

    with jax.set_mesh(mesh):
        modes = [LOW]
        state = run(dp.init({k: jnp.asarray(0.1 * d) for k, d in DIRECTIONS.items()}), 3, modes)
        options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
        with ocp.CheckpointManager(tmp_path, options=options) as manager:
            manager.save(3, args=ocp.args.StandardSave(state))
            manager.wait_until_finished()
        accordion_state = state.opt_state[0]
        assert accordion_state.leaves["a"].accum.value.sharding.spec == P(comm.DATA)
        continued = run(state, modes=modes)
        assert switched, modes
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            continued,
            dp.state_sharding(PARAMS),
        )
        with ocp.CheckpointManager(tmp_path, options=options) as manager:
            restored = manager.restore(3, args=ocp.args.StandardRestore(abstract))
        assert jax.tree.structure(restored) == jax.tree.structure(continued)
        resumed = run(restored)
    for a, b in zip(jax.tree.leaves(continued), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_composes_with_adamw(mesh):
    tx = optax.chain(
        transforms.accordion(compressors.top_k(0.5), compressors.top_k(0.1), interval_steps=2),
        optax.adamw(1e-2, weight_decay=1e-4),
    )
    dp = parallel.data_parallel(mlp_loss, tx, mesh)
    state = dp.init({k: jnp.asarray(0.1 * d) for k, d in DIRECTIONS.items()})
    losses = []
    for _ in range(6):
        state, metrics = dp.step(state, BATCH)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_inject_hyperparams_learning_rate_drop_switches_everything_low():
    tx = optax.inject_hyperparams(
        transforms.accordion,
        static_args=("min_compression_rate", "min_ndim", "interval_steps", "check_every", "seed"),
    )(interval_steps=4, check_every=1, learning_rate=0.1, axis_name=None)
    state = tx.init(PARAMS)
    g = {k: jnp.asarray(d) for k, d in DIRECTIONS.items()}
    update = jax.jit(tx.update)
    for step in range(8):  # identical norms: the second check (step 7) goes to high compression
        _, state = update(g, state)
        if step == 6:
            assert int(state.inner_state.leaves["a"].mode) == LOW
            q_used = np.asarray(state.inner_state.leaves["a"].low.q.q)
    assert int(transforms.accordion_metrics(state)["modes"]["a"]) == HIGH
    # the periodic switch resets the incoming Q and keeps the error memory (with
    # reset_memory_on_switch=True it zeroes it instead: the extra-args test's run)
    leaf = state.inner_state.leaves["a"]
    fresh = compressors.power_sgd(1).init(PARAMS["a"]).q
    np.testing.assert_array_equal(np.asarray(leaf.high.q.q), fresh)
    assert not np.array_equal(np.asarray(leaf.low.q.q), q_used)  # low kept warm-starting
    assert np.abs(np.asarray(leaf.memory.residual.value)).max() > 0
    lr = state.hyperparams["learning_rate"]
    state.hyperparams["learning_rate"] = jnp.asarray(0.01, lr.dtype)  # a manual decay
    _, state = update(g, state)
    assert int(transforms.accordion_metrics(state)["modes"]["a"]) == LOW
    assert float(state.inner_state.last_lr) == pytest.approx(0.01)


@pytest.mark.slow
def test_learning_rate_from_extra_args_overrides_the_schedule_and_keeps_the_memory():
    """A decrease switches to low compression; unlike a periodic switch it keeps the memory
    even with ``reset_memory_on_switch`` (the reference's ``--zero-memory``)."""
    tx = transforms.accordion(
        interval_steps=4, check_every=1, axis_name=None, learning_rate=0.1,
        reset_memory_on_switch=True,
    )  # fmt: skip
    state = tx.init(PARAMS)
    g = {k: jnp.asarray(d) for k, d in DIRECTIONS.items()}
    update = jax.jit(tx.update)
    for step in range(9):  # two intervals of equal norms: the second check goes high
        _, state = update(g, state, learning_rate=0.1)
        if step == 7:  # the periodic switch zeroed the memory
            assert int(state.leaves["a"].mode) == HIGH
            assert not np.any(np.asarray(state.leaves["a"].memory.residual.value))
    memory = state.leaves["a"].memory.residual.value[0]
    assert np.abs(np.asarray(memory)).max() > 0
    means, state = update(g, state, learning_rate=0.05)
    assert int(state.leaves["a"].mode) == LOW
    codec = compressors.power_sgd(2)  # the incoming codec restarts from its initial Q

    @jax.jit
    def low(c):
        return codec.decompress(codec.compress(c, codec.init(c), None)[0], c)

    np.testing.assert_allclose(means["a"], low(g["a"] + memory), rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="Codec"):
        transforms.accordion(optax.sgd(0.1), interval_steps=2)
    with pytest.raises(ValueError, match="interval_steps"):
        transforms.accordion(interval_steps=0)
    with pytest.raises(ValueError, match="check_every"):
        transforms.accordion(interval_steps=2, check_every=-1)
    with pytest.raises(ValueError, match="eta"):
        transforms.accordion(interval_steps=2, eta=0)
    with pytest.raises(ValueError, match="statistic"):
        transforms.accordion(interval_steps=2, statistic="median")
    with pytest.raises(ValueError, match="learning_rate"):
        transforms.accordion(interval_steps=2, learning_rate="0.1")
    tx = transforms.accordion(interval_steps=2, axis_name=None)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="does not match"):
        tx.update({"a": PARAMS["a"]}, state)


def test_init_runs_outside_shard_map_and_places_on_the_mesh(mesh):
    tx = transforms.accordion(interval_steps=2)
    state = tx.init(PARAMS)  # where optax users call it: no mesh, no shard_map
    leaf = state.leaves["a"]
    assert leaf.accum.value.shape == (1, 16, 16) and leaf.memory.residual.value.shape == (1, 16, 16)
    placed = comm.place_state(state, mesh, comm.DATA)
    assert placed.leaves["a"].accum.value.shape == (W, 16, 16)
    assert placed.leaves["a"].accum.value.sharding.spec == P(comm.DATA)
    assert placed.leaves["a"].low.q.q.sharding.spec == P()
    specs = comm.state_specs(state, comm.DATA)
    assert specs.leaves["a"].memory.residual.value == P(comm.DATA) and specs.count == P()
