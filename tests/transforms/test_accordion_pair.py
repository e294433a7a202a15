"""accordion over a (slow, fast) axis pair on a 2 x 4 mesh: dense over the fast axis, the codec
of each parameter's mode over the slow one; == Accordion over the slow axis fed each host's mean,
the same modes on every device (uniform predicates), compressed bytes only on the slow links."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import transforms as T

#: pair == the reference and == a flat axis to rtol 2e-5, the collectives' groups and bytes
#  (the compiled HLO is the same with optimisations off): the programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

SLOW, FAST = "slow", "fast"
SHAPE = (16, 8)
SCALES = (1.0, 1.0, 3.0, 3.0)  # interval norms: first, same (high), x3 (low), same (high)
MODES = [T.LOW_COMPRESSION, T.HIGH_COMPRESSION, T.LOW_COMPRESSION, T.HIGH_COMPRESSION]


def _tx(axis_name, statistic="worker0"):
    return T.accordion(C.power_sgd(2), C.power_sgd(1), interval_steps=1, check_every=1,
                       axis_name=axis_name, statistic=statistic)  # fmt: skip


@pytest.fixture(scope="module")
def grads(pair_grads):
    return pair_grads(SHAPE)


def _run(step, state, sharding, grads):
    """Means, modes of ``w`` and states over the steps of ``SCALES``."""
    out = []
    for scale in SCALES:
        g = jax.device_put(jax.tree.map(lambda x, c=scale: x * c, grads), sharding)
        mean, state = step(g, state)
        out.append((mean, int(T.accordion_metrics(state)["modes"]["w"]), state))
    return out


@pytest.fixture(scope="module")
def pair_run(pair_mesh, grads, pair_update):
    step, state, sharding = pair_update(_tx((SLOW, FAST)), pair_mesh, (SLOW, FAST), SLOW, grads)
    return step, state, sharding, _run(step, state, sharding, grads)


def test_pair_is_accordion_over_slow_of_the_host_means(pair_mesh, grads, pair_run, pair_update):
    """== the same transform over the slow axis alone (2 devices) fed each host's dense mean:
    the same means, modes (switching low, high, low, high) and slow-axis bytes."""
    host = {k: v.reshape(2, 4, *v.shape[1:]).mean(1) for k, v in grads.items()}
    flat = comm.make_mesh([(SLOW, 2)], devices=jax.devices()[:2])
    ref = _run(*pair_update(_tx(SLOW), flat, SLOW, SLOW, host), host)
    got = pair_run[3]
    assert [m for _, m, _ in got] == [m for _, m, _ in ref] == MODES
    for (mean, _, s), (ref_mean, _, ref_s) in zip(got, ref):
        for k in grads:
            np.testing.assert_allclose(np.asarray(mean[k]), np.asarray(ref_mean[k]), rtol=2e-5,
                                       atol=1e-6)  # fmt: skip
        assert float(s.bytes_sent) == float(ref_s.bytes_sent) > 0
        assert float(s.fast_bytes_sent) == 4 * (16 * 8 + 8)
        assert float(ref_s.fast_bytes_sent) == 0
    # per-worker state belongs to a slow worker: one accumulator per host, sharded over slow
    accum = got[-1][2].leaves["w"].accum.value
    assert accum.shape == (2, *SHAPE) and accum.sharding.spec == P(SLOW)


def test_pair_with_the_mean_statistic_equals_a_flat_axis_of_eight_when_hosts_agree(
    pair_mesh, grads, pair_update
):
    """Where every device of a host has the same gradient, the fast mean is exact and the
    8-worker mean of norms is the hosts': == a flat axis. (The default statistic, worker 0's
    norm, is checked on any gradients by test_pair_is_accordion_over_slow_of_the_host_means:
    where hosts agree, its reference, the slow axis fed the host means, is the flat axis's
    numbers.)"""
    same = {k: np.repeat(v[::4], 4, axis=0) for k, v in grads.items()}  # host h: device 4h's
    data = comm.make_mesh([(comm.DATA, 8)])
    ref = _run(*pair_update(_tx(comm.DATA, "mean"), data, comm.DATA, comm.DATA, same), same)
    got = _run(*pair_update(_tx((SLOW, FAST), "mean"), pair_mesh, (SLOW, FAST), SLOW, same), same)
    assert [m for _, m, _ in got] == [m for _, m, _ in ref] == MODES
    for (mean, _, _), (ref_mean, _, _) in zip(got, ref):
        for k in grads:
            np.testing.assert_allclose(np.asarray(mean[k]), np.asarray(ref_mean[k]), rtol=2e-5,
                                       atol=1e-6)  # fmt: skip


def test_every_mode_switch_is_uniform_over_both_axes(pair_run, grads):
    step, state, sharding, _ = pair_run
    report = comm.check_collective_uniformity(step, jax.device_put(grads, sharding), state)
    assert report.branches >= 2  # the mode conds of w and the statistic's cond


def test_hlo_dense_on_fast_compressed_on_slow(pair_run, grads):
    step, state, sharding, _ = pair_run
    report = comm.measure_collectives(step, jax.device_put(grads, sharding), state)
    fast = [r for r in report.records if r.group_size == 4]
    slow = [r for r in report.records if r.group_size == 2]
    assert len(fast) + len(slow) == len(report.records), report.table()  # none over all 8
    dense = "f32[16,8]"
    assert any(dense in r.shape for r in fast), report.table()
    assert slow and not any(dense in r.shape for r in slow), report.table()
    # both modes' PowerSGD factors cross the slow links (each branch counted once): rank 2 and
    # rank 1 P [16, r] and Q [8, r], the statistic (one float per compressed parameter) and
    # the bias, dense (min_ndim=2)
    assert sum(r.total_bytes for r in slow) == 4 * ((16 + 8) * (2 + 1) + 1 + 8), report.table()
    assert sum(r.total_bytes for r in fast) == 4 * (16 * 8 + 8), report.table()


def test_bad_pairs_are_named():
    with pytest.raises(ValueError, match="pair of distinct names"):
        _tx((SLOW, SLOW))
    with pytest.raises(ValueError, match="pair of distinct names"):
        _tx((SLOW, FAST, "x"))


def test_a_fast_axis_missing_from_the_mesh_is_named(grads, pair_update):
    """The pair's fast axis must be an axis of the shard_map (not silently skipped)."""
    flat = comm.make_mesh([(SLOW, 2)], devices=jax.devices()[:2])
    host = {k: v[:2] for k, v in grads.items()}
    step, state, sharding = pair_update(_tx((SLOW, FAST)), flat, SLOW, SLOW, host)
    with pytest.raises(Exception, match="fast"):
        step(jax.device_put(host, sharding), state)
