"""Accordion's detector at the edges: magnitudes 1e-30 .. 3e38, zeros, NaN/Inf, wrong shapes.

The critical-regime test compares relative changes of a norm, so scaling a whole gradient
sequence by any magnitude must give the same decisions as at 1.0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import _regime
from jaxcomp import comm
from jaxcomp import transforms
from jaxcomp.transforms import HIGH_COMPRESSION as HIGH
from jaxcomp.transforms import LOW_COMPRESSION as LOW

MAGNITUDES = [1e-30, 1e-10, 1.0, 1e6, 1e30, 3e38]
SHAPES = {"a": (8, 8), "b": (8, 4)}
PARAMS = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
DIRECTIONS = {  # float64, max-abs 1: the gradients never exceed the magnitude
    k: (lambda d: d / np.abs(d).max())(np.random.default_rng(i).standard_normal(s))
    for i, (k, s) in enumerate(SHAPES.items())
}
# per interval, relative changes far from eta = 0.5 (no decision within rounding of it)
SCALE_A = [1.0, 0.9, 0.3, 0.32, 0.9, 0.88, 0.2, 0.21]
SCALE_B = [0.5, 0.1, 0.11, 0.12, 0.5, 1.0, 0.98, 0.3]
STEPS = 2  # steps per interval: an interval's sum of 3e38 gradients exceeds float32


def grads(scale_a, scale_b, magnitude):
    g = {"a": scale_a * DIRECTIONS["a"], "b": scale_b * DIRECTIONS["b"]}
    return {k: jnp.asarray(magnitude * v, jnp.float32) for k, v in g.items()}


def expected_modes(scales, eta=0.5):
    """Mode used in each interval with check_every=1, from float64 norms of the sums."""
    modes, prev = [LOW], None
    for scale in scales[:-1]:
        norm = STEPS * scale
        ratio = 9.0 if prev in (None, 0.0) else abs(prev - norm) / prev
        modes.append(LOW if prev is None or not ratio < eta else HIGH)
        prev = norm
    return modes


@pytest.fixture(scope="module")
def accordion_update():
    tx = transforms.accordion(
        interval_steps=STEPS, check_every=1, axis_name=None, min_compression_rate=0
    )
    return tx, jax.jit(tx.update)


def run_accordion(accordion_update, sequence):
    """The modes ``[a, b]`` each interval used, and the final state."""
    tx, update = accordion_update
    state, used = tx.init(PARAMS), []
    for g in sequence:
        for step in range(STEPS):
            _, state = update(g[step] if isinstance(g, list) else g, state)
            if step == 0:
                modes = transforms.accordion_metrics(state)["modes"]
                used.append([int(modes["a"]), int(modes["b"])])
    return used, state


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_accordion_decides_alike_at_every_magnitude(accordion_update, magnitude):
    used, state = run_accordion(
        accordion_update, [grads(a, b, magnitude) for a, b in zip(SCALE_A, SCALE_B)]
    )
    want = list(zip(expected_modes(SCALE_A), expected_modes(SCALE_B)))
    assert used == [list(m) for m in want]
    assert {LOW, HIGH} <= {m for row in want for m in row}
    for leaf in state.leaves.values():
        assert np.isfinite(float(leaf.prev_norm)) and float(leaf.prev_norm) > 0


def test_accordion_all_zero_gradients_are_critical(accordion_update):
    """0 / 0 in the relative change: the reference's ratio 9, so low compression throughout."""
    used, state = run_accordion(accordion_update, [grads(0.0, 0.0, 1.0)] * 3)
    assert used == [[LOW, LOW]] * 3
    assert all(float(leaf.prev_norm) == 0.0 for leaf in state.leaves.values())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_accordion_non_finite_step_is_critical_then_recovers(accordion_update, bad):
    """A non-finite gradient in interval 2: its check (and the next, which has no finite
    baseline) are critical; from then on the decisions are the clean run's."""
    clean = [grads(a, b, 1.0) for a, b in zip(SCALE_A, SCALE_B)]
    poisoned = list(clean)
    hit = dict(clean[2])
    hit["a"] = hit["a"].at[0, 0].set(bad)
    poisoned[2] = [hit, clean[2]]  # the interval's first step only
    want, _ = run_accordion(accordion_update, clean)
    got, state = run_accordion(accordion_update, poisoned)
    assert got[3] == [LOW, want[3][1]] and got[4] == [LOW, want[4][1]]
    assert got[:3] == want[:3] and got[5:] == want[5:]
    assert want[3][0] == HIGH or want[4][0] == HIGH  # the poisoned checks changed something
    assert np.isfinite(float(state.leaves["a"].prev_norm))


def test_accordion_shape_other_than_inits_is_a_clear_error(accordion_update):
    tx, update = accordion_update
    state = tx.init(PARAMS)
    wrong = {"a": jnp.ones((8, 4)), "b": jnp.ones((8, 4))}
    with pytest.raises(ValueError, match=r"accordion.*\ba\b"):
        update(wrong, state)


# ----------------------------------------------------------------------------------------------
# accordion_batch_size

SMALL, LARGE = 1, 4


@pytest.fixture(scope="module")
def batch_update():
    tx = transforms.accordion_batch_size(
        optax.sgd(1.0), interval_steps=LARGE, small_steps=SMALL, large_steps=LARGE,
        check_every=1, lr_scaling="none", axis_name=None,
    )  # fmt: skip
    return tx, jax.jit(tx.update)


def run_batch(batch_update, sequence):
    """``every_k`` at each interval's start, the updates emitted (with the float64 means they
    should equal), and the final state."""
    tx, update = batch_update
    state, ks, emitted, pending = tx.init(PARAMS), [], [], []
    for g in sequence:
        ks.append(int(transforms.batch_size_metrics(state)["every_k"]))
        for _ in range(LARGE):
            k = int(transforms.batch_size_metrics(state)["every_k"])
            updates, state = update(g, state)
            pending.append(g)
            if len(pending) == k:
                want = {n: -np.mean([np.float64(p[n]) for p in pending], 0) for n in SHAPES}
                emitted.append((updates, want))
                pending = []
    return ks, emitted, state


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_batch_size_decides_alike_and_averages_at_every_magnitude(batch_update, magnitude):
    seq = [grads(a, b, magnitude) for a, b in zip(SCALE_A, SCALE_A)]
    ks, emitted, _ = run_batch(batch_update, seq)
    norms = [np.hypot(np.linalg.norm(DIRECTIONS["a"]), np.linalg.norm(DIRECTIONS["b"])) * s
             for s in SCALE_A]  # fmt: skip
    want, prev = [SMALL], None
    for norm in norms[:-1]:
        critical = prev is None or not abs(prev - norm) / prev < 0.5
        want.append(SMALL if critical else LARGE)
        prev = norm
    assert ks == want and LARGE in ks
    for got, ref in emitted:
        for n in SHAPES:
            np.testing.assert_allclose(np.float64(got[n]) / magnitude, ref[n] / magnitude,
                                       rtol=1e-5, atol=1e-6)  # fmt: skip


def test_batch_size_all_zero_gradients_keep_the_small_batch(batch_update):
    ks, _, state = run_batch(batch_update, [grads(0.0, 0.0, 1.0)] * 3)
    assert ks == [SMALL] * 3 and float(state.prev_norm) == 0.0


def test_batch_size_non_finite_interval_is_critical_then_recovers(batch_update):
    clean = [grads(a, a, 1.0) for a in SCALE_A]
    poisoned = list(clean)
    poisoned[2] = {"a": clean[2]["a"].at[1, 1].set(np.nan), "b": clean[2]["b"]}
    want, _, _ = run_batch(batch_update, clean)
    got, _, state = run_batch(batch_update, poisoned)
    assert got[3] == got[4] == SMALL and LARGE in (want[3], want[4])
    assert got[:3] == want[:3] and got[5:] == want[5:]
    assert np.isfinite(float(state.prev_norm))


def test_batch_size_shape_other_than_inits_is_a_clear_error(batch_update):
    tx, update = batch_update
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"accordion_batch_size.*\ba\b"):
        update({"a": jnp.ones((4, 8)), "b": jnp.ones((8, 4))}, state)


# ----------------------------------------------------------------------------------------------
# the shared test and statistic


@pytest.mark.parametrize("magnitude", [1e-30, 1e-10, 1.0, 1e6, 1e30, 1.5e38])
@pytest.mark.parametrize(("change", "critical"), [(1.2, False), (2.0, True), (0.4, True)])
def test_critical_regime_is_relative_at_every_magnitude(magnitude, change, critical):
    prev = jnp.float32(magnitude)
    norm = jnp.float32(magnitude * change)
    got = jax.jit(transforms.critical_regime)(prev, norm, 0.5, False)
    assert bool(got) is critical


def test_mean_statistic_does_not_overflow_at_the_largest_norms():
    mesh = comm.make_mesh([(comm.DATA, 4)], devices=jax.devices()[:4])
    norms = np.asarray([[3e38, 1.0], [3e38, 3.0], [3e38, 2.0], [3e38, 2.0]], np.float32)

    def mean(x):
        return _regime.replicated_norms(x[0], comm.DATA, "mean")

    fn = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(comm.DATA), out_specs=P()))
    np.testing.assert_allclose(np.asarray(fn(norms)), [3e38, 2.0], rtol=1e-6)
