"""The alpha-beta cost model against hand-computed step times, the HLO meter, and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import study

LK = study.NetworkLink(bandwidth=1000.0, latency=0.01)  # 100 bytes take 0.1 s on the wire


def test_collective_formulas_by_hand():
    t = study.collective_time
    assert t("collective-permute", 100.0, 8, LK) == pytest.approx(0.01 + 0.1)
    # ring all-reduce, W=4, 1000 bytes: 2*3 latencies + 2*3/4 of the bytes
    assert t("all-reduce", 1000.0, 4, LK) == pytest.approx(6 * 0.01 + 1.5)
    # ring all-gather, W=4, 100 bytes contributed per device: 3 hops of 100 bytes
    assert t("all-gather", 100.0, 4, LK) == pytest.approx(3 * 0.01 + 0.3)
    assert t("reduce-scatter", 1000.0, 4, LK) == pytest.approx(3 * 0.01 + 0.75)
    assert t("all-to-all", 1000.0, 4, LK) == pytest.approx(3 * 0.01 + 0.75)
    assert t("ragged-all-to-all", 1000.0, 4, LK) == t("all-to-all", 1000.0, 4, LK)
    assert t("collective-broadcast", 100.0, 8, LK) == pytest.approx(3 * (0.01 + 0.1))
    assert t("collective-broadcast", 100.0, 5, LK) == pytest.approx(3 * (0.01 + 0.1))


def test_zero_bytes_and_one_worker_cost_nothing():
    for kind in study.KINDS:
        assert study.collective_time(kind, 0.0, 8, LK) == 0.0
        assert study.collective_time(kind, 1e9, 1, LK) == 0.0
    assert study.communication_time([], LK) == 0.0
    assert study.step_time(0.25, [study.Collective("all-reduce", 0.0, 8)], LK) == 0.25


def test_communication_time_reads_the_hlo_meter_report():
    """The model prices what measure_collectives counts: an all-reduce and an all-gather."""
    mesh = jax.make_mesh((8,), ("d",))

    def body(x):
        return lax.psum(x, "d"), lax.all_gather(x[:, :64], "d", to="invarying")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P())))
    x = jax.device_put(jnp.ones((8, 256)), jax.sharding.NamedSharding(mesh, P("d")))
    report = comm.measure_collectives(f, x)
    assert report.bytes_by_kind() == {"all-reduce": 1024.0, "all-gather": 256.0}
    expected = (14 * 0.01 + 2 * 7 / 8 * 1024 / 1000) + (7 * 0.01 + 7 * 256 / 1000)
    assert study.communication_time(report, LK) == pytest.approx(expected)
    assert study.communication_time(report.records, LK) == pytest.approx(expected)


def test_pipeline_two_stages_by_hand():
    """S=2, M=2, f=1, b=2, every send 0.1 + 100 / 1000 = 0.2 s."""
    lk = study.NetworkLink(bandwidth=1000.0, latency=0.1)  # a 100-byte send takes 0.2 s
    args = (1.0, 2.0, 2, 100.0, 100.0, lk)
    # lockstep (jaxcomp's GPipe): 3 ticks of 1 forward, 3 of 2 backward, then 2 x 2 sends
    assert study.pipeline_step_time(*args, num_stages=2) == pytest.approx(9.0 + 4 * 0.2)
    # asynchronous: F0 [0,1] F1 [1,2] | F0 [1.2,2.2] F1 [2.2,3.2] B1 [3.2,5.2] B0 [5.2,7.2]
    # | B1 [5.4,7.4] B0 [7.4,9.4]
    for schedule in study.SCHEDULES:
        got = study.pipeline_step_time(*args, num_stages=2, schedule=schedule, lockstep=False)
        assert got == pytest.approx(9.4), schedule


def test_heterogeneous_stages_gpipe_vs_1f1b_by_hand():
    """S=3, M=2, f=(1, 2, 1), b=1, free links: GPipe 10, 1F1B 9, lockstep 4 * 2 + 4 * 1."""
    free = study.NetworkLink(bandwidth=1.0, latency=0.0)
    args = ([1.0, 2.0, 1.0], [1.0, 1.0, 1.0], 2, 0.0, 0.0, free)
    assert study.pipeline_step_time(*args) == pytest.approx(12.0)
    assert study.pipeline_step_time(*args, lockstep=False) == pytest.approx(10.0)
    assert study.pipeline_step_time(*args, schedule="1f1b", lockstep=False) == pytest.approx(9.0)


def test_lockstep_adds_every_send_of_every_boundary():
    """S=3, M=2, f=b=1; sends 0.1 + bytes/1000: forward 0.2 and 0.4, backward 0 and 0.2."""
    lk = study.NetworkLink(bandwidth=1000.0, latency=0.1)
    got = study.pipeline_step_time(1.0, 1.0, 2, [100.0, 300.0], [0.0, 100.0], lk, num_stages=3)
    assert got == pytest.approx(4 * 2 + 2 * (0.2 + 0.4 + 0.0 + 0.2))
    # the same as compute plus the step's single-pair permutes as the HLO meter lists them
    sends = [study.Collective("collective-permute", n, 2, executions=2) for n in (100, 300, 100)]
    assert study.step_time(4 * 2, sends, lk) == pytest.approx(got)


def test_a_busy_link_serialises_sends():
    """150 bytes at 100 B/s take 1.5 s on the wire: the second send waits for the first."""
    lk = study.NetworkLink(bandwidth=100.0, latency=0.1)
    # F0 [0,1] sent [1, 2.5] arrives 2.6; F1 [1,2] waits for the wire, sent [2.5, 4] -> 4.1;
    # stage 1: F0 [2.6,3.6] F1 [4.1,5.1] B1 [5.1,6.1] B0 [6.1,7.1]; no backward bytes
    # stage 0: B1 [6.1,7.1] B0 [7.1,8.1]
    got = study.pipeline_step_time(1.0, 1.0, 2, 150.0, 0.0, lk, num_stages=2, lockstep=False)
    assert got == pytest.approx(8.1)


@pytest.mark.parametrize("stages, micro", [(1, 3), (2, 1), (3, 4), (4, 8)])
def test_uniform_free_pipelines_give_the_textbook_bubble(stages, micro):
    free = study.NetworkLink(bandwidth=1.0, latency=0.0)
    expected = (micro + stages - 1) * (1.0 + 3.0)
    kw = dict(num_stages=stages)
    assert study.pipeline_step_time(1.0, 3.0, micro, 0.0, 0.0, free, **kw) == expected
    for schedule in study.SCHEDULES:
        got = study.pipeline_step_time(
            1.0, 3.0, micro, 0.0, 0.0, free, schedule=schedule, lockstep=False, **kw
        )
        assert got == pytest.approx(expected)


def test_asynchronous_never_slower_than_lockstep():
    rng = np.random.default_rng(0)
    lk = study.network_link(1.0)
    for _ in range(20):
        s, m = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        f, b = rng.uniform(0.01, 1, s), rng.uniform(0.01, 1, s)
        fb, bb = rng.uniform(0, 1e8, s - 1), rng.uniform(0, 1e8, s - 1)
        lock = study.pipeline_step_time(f, b, m, fb, bb, lk)
        free = study.pipeline_step_time(f, b, m, fb, bb, lk, lockstep=False)
        assert free <= lock + 1e-12


def test_predicted_speedups():
    dense = [study.Collective("all-reduce", 4e8, 4)]
    assert study.predicted_speedups(dense, dense, 0.1) == {1.0: 1.0, 10.0: 1.0, 100.0: 1.0}
    topk = [study.Collective("all-gather", 8e6, 4)]
    got = study.predicted_speedups(dense, topk, 0.1)
    assert list(got) == [1.0, 10.0, 100.0]
    assert got[1.0] > got[10.0] > got[100.0] > 1.0  # compression pays most on slow links
    base = 0.1 + 6e-5 + 1.5 * 4e8 / 1.25e8
    assert got[1.0] == pytest.approx(base / (0.1 + 3e-5 + 3 * 8e6 / 1.25e8))
    slower = study.predicted_speedups(dense, topk, 0.2, base_compute_s=0.1)
    assert all(slower[g] < got[g] for g in got)  # compression's own compute counts


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "fast", None])
def test_invalid_bandwidth_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="gbit_per_s"):
        study.network_link(bad)
    with pytest.raises(ValueError, match="link.bandwidth"):
        study.collective_time("all-reduce", 1.0, 2, study.NetworkLink(bad, 0.0))


def test_other_invalid_input_is_a_clear_error():
    with pytest.raises(ValueError, match="latency_s"):
        study.network_link(1.0, latency_s=-1e-6)
    with pytest.raises(ValueError, match="link must be a study.NetworkLink"):
        study.collective_time("all-reduce", 1.0, 2, (1e9, 0.0))
    with pytest.raises(ValueError, match="kind must be one of"):
        study.collective_time("all_reduce", 1.0, 2, LK)
    with pytest.raises(ValueError, match="nbytes"):
        study.collective_time("all-reduce", math.nan, 2, LK)
    for group in (0, 2.0, True):
        with pytest.raises(ValueError, match="group_size"):
            study.collective_time("all-reduce", 1.0, group, LK)
    for runs in (-1, math.nan, math.inf, True):  # a mean over steps may be fractional, not these
        with pytest.raises(ValueError, match="executions"):
            study.communication_time([study.Collective("all-reduce", 1.0, 2, runs)], LK)
    with pytest.raises(ValueError, match="compute_s"):
        study.step_time(-0.1, [], LK)
    with pytest.raises(ValueError, match="candidate_s"):
        study.speedup(1.0, 0.0)
    with pytest.raises(ValueError, match="num_microbatches"):
        study.pipeline_step_time(1.0, 1.0, 0, 0.0, 0.0, LK, num_stages=2)
    with pytest.raises(ValueError, match="forward_bytes needs 1 values"):
        study.pipeline_step_time([1.0, 1.0], [1.0, 1.0], 2, [1.0, 2.0], 0.0, LK)
    with pytest.raises(ValueError, match="backward_s needs 2"):
        study.pipeline_step_time([1.0, 1.0], [1.0], 2, 0.0, 0.0, LK)
    with pytest.raises(ValueError, match="num_stages is needed"):
        study.pipeline_step_time(1.0, 1.0, 2, 0.0, 0.0, LK)
    with pytest.raises(ValueError, match="schedule must be one of"):
        study.pipeline_step_time(1.0, 1.0, 2, 0.0, 0.0, LK, num_stages=2, schedule="zb")
    with pytest.raises(ValueError, match="lockstep"):
        study.pipeline_step_time(1.0, 1.0, 2, 0.0, 0.0, LK, num_stages=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"forward_s\[1\]"):
        study.pipeline_step_time([1.0, math.inf], 1.0, 2, 0.0, 0.0, LK)


def test_a_pipeline_schedule_without_an_operation_order_is_an_error(monkeypatch):
    from jaxcomp.study import _cost

    monkeypatch.setattr(_cost, "SCHEDULES", (*_cost.SCHEDULES, "interleaved"))
    with pytest.raises(NotImplementedError, match="no operation order for 'interleaved'"):
        study.pipeline_step_time(1.0, 1.0, 4, 1.0, 1.0, LK, num_stages=2,
                                 schedule="interleaved", lockstep=False)  # fmt: skip


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_operation_order_is_the_pipeline_tick_tables(schedule):
    from jaxcomp import pipeline
    from jaxcomp.study import _cost

    for s_n, m in [(1, 1), (2, 3), (4, 5)]:
        table = pipeline.ticks(schedule, s_n, m)
        for s in range(s_n):
            ran = [(op.kind, op.microbatch) for row in table if (op := row[s])]
            assert _cost._schedule_order(schedule, s, s_n, m) == ran, (s_n, m, s)
