"""Lab runs beside the cost model: step times without warm-up and idle-gap steps, time to
accuracy, and the prediction (compute from the unlimited run, communication from the
calibrated links), in the study report."""

import json

import pytest

from jaxcomp.study import _cost
from jaxcomp.study import _network
from jaxcomp.study import write_report

FITS = {"all-reduce": {"alpha_s": 1e-4, "beta_bytes_s": 1e7, "beta_bit_s": 8e7}}
COLLS = [{"kind": "all-reduce", "group_size": 8, "bytes_per_execution": 4e5, "executions": 1.0,
          "conditional": False}]  # fmt: skip


def _run(path, rate, step_s, *, evals=((4, 0.5), (8, 0.9)), variant="dense"):
    """A lab run's workdir: 8 steps of ``step_s`` (steps 1 and 5 slow: warm-up, after the
    evaluation at step 4), evaluations, a summary with one all-reduce, and ``lab.json``."""
    path.mkdir(parents=True)
    with open(path / "timing.jsonl", "w") as f:
        for s in range(1, 9):
            t = step_s * (5 if s in (1, 5) else 1)
            f.write(json.dumps({"step": s, "step_s": t, "elapsed_s": 10 + s * step_s}) + "\n")
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 8, "split": "train", "loss": 0.5}) + "\n")
        for s, acc in evals:
            f.write(json.dumps({"step": s, "split": "eval", "accuracy": acc, "loss": 1}) + "\n")
    summary = {"mode": "dense", "steps": 8, "final_accuracy": evals[-1][1],
               "wire_bytes_per_step": 4e5, "collectives": COLLS}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "experiment.json").write_text(json.dumps({"mesh": [["data", 8]]}))
    net = {"topology": "per_host", "hosts": 2, "devices_per_host": 4,
           "rate": "unlimited" if rate is None else "100mbit", "rate_bit_s": rate}  # fmt: skip
    lab = {"name": path.name, "variant": variant, "axes": {}, "network": net,
           "calibration": {"fits": FITS, "achieved": {"bit_s": 9.5e7}}, "targets": [0.9],
           "load_before": [1.0], "load_after": [1.2]}  # fmt: skip
    (path / _network.LAB_FILE).write_text(json.dumps(lab))
    return str(path)


def test_step_times_leave_out_warm_up_and_the_step_after_an_evaluation(tmp_path):
    st = _network.step_times(_run(tmp_path / "r", None, 0.01))
    assert st["left_out"] == [1, 2, 5] and st["n"] == 5
    assert st["median_s"] == st["q25_s"] == st["q75_s"] == pytest.approx(0.01)
    # a checkpoint every 3 steps also leaves out steps 4 and 7
    assert _network.step_times(str(tmp_path / "r"), checkpoint_every=3)["left_out"] == [
        1, 2, 4, 5, 7]  # fmt: skip


def test_time_to_accuracy_sums_the_steps_up_to_the_first_evaluation_on_target(tmp_path):
    w = _run(tmp_path / "r", None, 0.01)
    tta = _network.time_to_accuracy(w, [0.9, 0.99])
    assert tta["0.99"] is None
    assert tta["0.9"]["step"] == 8 and tta["0.9"]["train_s"] == pytest.approx(0.16)
    assert tta["0.9"]["elapsed_s"] == pytest.approx(10.08)


def test_time_to_loss_is_the_first_finite_evaluation_at_or_below_the_target(tmp_path):
    w = _run(tmp_path / "r", None, 0.01)  # evaluation losses 1 at steps 4 and 8
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:  # a NaN loss is not on target
        f.write(json.dumps({"step": 6, "split": "eval", "loss": float("nan")}) + "\n")
    ttl = _network.time_to_loss(w, [1.0, 0.5])
    assert ttl["0.5"] is None
    assert ttl["1"]["step"] == 4 and ttl["1"]["loss"] == 1
    assert ttl["1"]["train_s"] == pytest.approx(0.08)  # the slow first step + 3 of 0.01 s
    assert ttl["1"]["elapsed_s"] == pytest.approx(10.04)
    assert _network.time_to_loss(w, [float("nan")]) == {"nan": None}
    lab = json.loads((tmp_path / "r" / _network.LAB_FILE).read_text())
    (tmp_path / "r" / _network.LAB_FILE).write_text(json.dumps({**lab, "loss_targets": [1.0]}))
    record = _network.read_lab_run(w)
    assert record["measured"]["time_to_loss"]["1"]["step"] == 4
    assert "loss 1: 0.1 / 10.0" in _network.table([record])


def test_prediction_takes_compute_from_the_unlimited_run(tmp_path):
    runs = [_network.read_lab_run(_run(tmp_path / n, r, t))
            for n, r, t in (("u", None, 0.05), ("slow", 1e8, 0.2))]  # fmt: skip
    runs.append(_network.read_lab_run(_run(tmp_path / "x", 1e8, 0.2, variant="other")))
    unl, slow, other = _network.predict(runs)
    comm = _cost.collective_time("all-reduce", 4e5, 8, _cost.NetworkLink(1e7, 1e-4))
    assert unl["prediction"]["compute_s"] == pytest.approx(0.05 - comm)
    assert unl["prediction"]["measured_over_predicted"] == pytest.approx(1.0)
    assert slow["prediction"]["step_s"] == pytest.approx(0.05)  # both runs share the fit here
    assert slow["prediction"]["measured_over_predicted"] == pytest.approx(4.0)
    assert other["prediction"]["step_s"] is None and "unlimited" in other["prediction"]["why"]
    table = _network.table([unl, slow])
    assert "| slow | per_host | 2 x 4 | 100mbit | 95 | 100 | 80 |" in table


def test_the_study_report_shows_lab_cells(tmp_path):
    names = ["dense__network=unlimited-2h__seed0", "dense__network=100mbit-2h__seed0"]
    for name, rate, t in zip(names, (None, 1e8), (0.05, 0.2)):
        _run(tmp_path / name, rate, t)
        (tmp_path / name / "cell.json").write_text(json.dumps({"status": "done"}))
    cells = [{"name": n, "variant": "dense", "axes": {"network": n.split("=")[1][:-7]},
              "seed": 0, "overrides": {}} for n in names]  # fmt: skip
    manifest = {"study": "s", "cells": cells, "axes": ["network"], "baseline": "dense"}
    (tmp_path / "study.json").write_text(json.dumps(manifest))
    paths = write_report(str(tmp_path))
    text = open(paths["markdown"]).read()
    assert _network.TABLE_NOTE in text and "| 100mbit |" in text
    assert {"accuracy_vs_time", "measured_vs_predicted"} <= set(paths)


@pytest.mark.parametrize(
    "topology, permutes, sends",
    [("per_host", None, 20), ("per_host", 12, 12), ("shared", None, 24), ("shared", 12, 12)],
)
def test_pipeline_sends_relay_through_the_stages_on_per_host_links(
    tmp_path, topology, permutes, sends
):
    """S=4, M=4 GPipe: 2 M (S-1) = 24 sends of 32 KiB. On per-host links each host runs its
    sends in program order and a send waits for its receiver: one permute per boundary (a run
    that records no ``permutes_per_step``, before 2026-12-05) puts 20 on the path, one permute
    per tick and direction 12 (its 12 moves); one wire carries all 24 sends' bytes either way,
    with one latency per permute that ran (24 or 12)."""
    w = _run(tmp_path / "p", 1e8, 0.05)
    summary = {"mode": "pipeline", "stages": 4, "microbatches": 4, "schedule": "gpipe",
               "boundary_bytes_per_step": 24 * 32768.0, "hlo_collective_bytes_per_step":
               24 * 32768.0, "wire_bytes_per_step": 24 * 32768.0}  # fmt: skip
    if permutes is not None:
        summary["permutes_per_step"] = permutes
    (tmp_path / "p" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "p" / "experiment.json").write_text(json.dumps({"mesh": [["stage", 4]]}))
    lab = json.loads((tmp_path / "p" / _network.LAB_FILE).read_text())
    lab["network"]["topology"] = topology
    (tmp_path / "p" / _network.LAB_FILE).write_text(json.dumps(lab))
    comm, _ = _network._comm(_network.read_lab_run(w))
    wire = 24 if topology == "shared" else sends
    assert comm == pytest.approx(sends * 1e-4 + wire * 32768.0 / 1e7)


def _pipe_run(path, rate, times, permute_beta):
    """A 2-stage, 2-microbatch GPipe lab run on per-host links: four sends of 10 kB (one per
    move), step times ``times`` for steps 3, 4, 6, 7, 8 (1 and 2 warm up, 5 follows the
    evaluation at 4), the ping-pong fit ``permute_beta`` bytes/s without latency or bucket."""
    w = _run(path, rate, 0.05)
    with open(path / "timing.jsonl", "w") as f:
        for s, t in zip((1, 2, 3, 4, 5, 6, 7, 8), (0.5, 0.5, *times[:2], 0.5, *times[2:])):
            f.write(json.dumps({"step": s, "step_s": t, "elapsed_s": 10 + s}) + "\n")
    summary = {"mode": "pipeline", "stages": 2, "microbatches": 2, "schedule": "gpipe",
               "boundary_bytes_per_step": 4e4, "hlo_collective_bytes_per_step": 4e4,
               "wire_bytes_per_step": 4e4, "permutes_per_step": 4}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "experiment.json").write_text(json.dumps({"mesh": [["stage", 2]]}))
    lab = json.loads((path / _network.LAB_FILE).read_text())
    lab["network"]["hosts"], lab["network"]["devices_per_host"] = 2, 1
    p2p = {"alpha_s": 0.0, "beta_bytes_s": permute_beta, "beta_bit_s": 8 * permute_beta}
    lab["calibration"]["fits"] = {**FITS, "collective-permute": p2p}
    (path / _network.LAB_FILE).write_text(json.dumps(lab))
    return _network.read_lab_run(w)


@pytest.mark.parametrize("beta, step, bound", [(1e6, 0.050, "link"), (1e7, 0.020, "compute")])
def test_a_per_host_pipeline_adds_its_sends_to_the_uncontended_compute(tmp_path, beta, step, bound):
    """The unlimited run's steps take 10-30 ms (median 20): the fastest is the compute
    without contention, the rest waits for a core. On per-host links a host that waits for its
    boundary leaves the cores to the others, so the step is the larger of the unlimited
    median and the fastest step's compute plus the sends: 4 sends of 10 kB at 1 MB/s (40 ms on
    the path) give 10 + 40 = 50 ms (the compute added: 60), at 10 MB/s (4 ms) the unlimited
    20 ms."""
    times = (0.010, 0.020, 0.020, 0.030, 0.030)
    unl = _pipe_run(tmp_path / "u", None, times, 1e12)
    slow = _pipe_run(tmp_path / "s", 1e8, (step,) * 5, beta)
    unl, slow = _network.predict([unl, slow])
    p = slow["prediction"]
    assert p["step_s"] == pytest.approx(step, abs=1e-6)
    assert p["bound"] == bound and p["free_compute_s"] == pytest.approx(0.010, abs=1e-6)
    assert p["communication_s"] == pytest.approx(4e4 / beta)
    assert unl["prediction"]["step_s"] == pytest.approx(0.020, abs=1e-6)


def test_an_unlimited_run_faster_than_its_modelled_sends_gives_no_pipeline_prediction(tmp_path):
    """The fastest unlimited step (10 ms) is shorter than the sends the unlimited calibration
    prices (40 ms): no compute is left to add to, so no prediction, with the reason."""
    unl = _pipe_run(tmp_path / "u", None, (0.010, 0.020, 0.020, 0.030, 0.030), 1e6)
    slow = _pipe_run(tmp_path / "s", 1e8, (0.05,) * 5, 1e6)
    p = _network.predict([unl, slow])[1]["prediction"]
    assert p["step_s"] is None and "fastest step is shorter" in p["why"]


def test_a_chain_calibration_prices_the_moves_whose_receiver_also_sends(tmp_path):
    """GPipe 4 x 4, one permute per tick and direction: 8 of its 12 moves are chains (2 or 3
    consecutive boundaries), each a send's go-ahead behind 32 KiB less the fit's offset; a
    calibration without the chain probe keeps the lockstep price."""
    w = _run(tmp_path / "p", 1e8, 0.05)
    summary = {"mode": "pipeline", "stages": 4, "microbatches": 4, "schedule": "gpipe",
               "boundary_bytes_per_step": 24 * 32768.0, "hlo_collective_bytes_per_step":
               24 * 32768.0, "wire_bytes_per_step": 24 * 32768.0,
               "permutes_per_step": 12}  # fmt: skip
    (tmp_path / "p" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "p" / "experiment.json").write_text(json.dumps({"mesh": [["stage", 4]]}))
    record = _network.read_lab_run(w)
    plain, _ = _network._comm(record)
    chain = {"offset_bytes": 768.0, "cap_bytes": 1e6, "beta_bytes_s": 1e7}
    record["calibration"] = {**record["calibration"], "chain": chain}
    chained, _ = _network._comm(record)
    one = _cost.collective_time("collective-permute", 32768.0, 2, _cost.NetworkLink(1e7, 1e-4))
    assert plain == pytest.approx(12 * one)
    assert chained == pytest.approx(12 * one + 8 * 32000 / 1e7)


HIER = [["slow", 2], ["fast", 4]]


def _hier(path, colls, wire, mesh=HIER, **summary):
    (path / "summary.json").write_text(
        json.dumps(
            {"mode": "data_parallel", "steps": 8, "wire_bytes_per_step": wire, "collectives": colls}
            | summary
        )
    )
    (path / "experiment.json").write_text(json.dumps({"mesh": mesh}))
    return _network.read_lab_run(str(path))


def _ar(group, nbytes, executions=1.0, conditional=False):
    return {"kind": "all-reduce", "group_size": group, "bytes_per_execution": nbytes,
            "executions": executions, "conditional": conditional}  # fmt: skip


def test_a_hierarchical_mesh_keeps_the_host_inside_off_the_link(tmp_path):
    """2 hosts x 4 devices, (slow, fast): the fast all-reduce (group 4) stays in the host, the
    slow one (group 2) runs as 4 rings through each NIC, the loss's (group 8) as the calibrated
    ring; Accordion's branched slow factors are scaled to the slow axis's bytes, not zeroed by
    the dense fast mean (which the run's wire bytes do not count)."""
    _run(tmp_path / "h", 1e8, 0.05)
    run = _hier(tmp_path / "h", [_ar(2, 5000.0), _ar(4, 6e5), _ar(8, 8.0)], 5008.0)
    comm, why = _network._comm(run)
    link = _cost.NetworkLink(1e7, 1e-4)
    want = _cost.collective_time("all-reduce", 4 * 5000.0, 2, link)
    want += _cost.collective_time("all-reduce", 8.0, 8, link)
    assert why == "" and comm == pytest.approx(want)
    assert run["measured"]["collectives_per_step"] == 3
    # the same step on the flat mesh prices every collective on the ring, as before
    flat = _hier(tmp_path / "h", [_ar(8, 5000.0)], 5000.0, mesh=[["data", 8]])
    assert _network._comm(flat)[0] == pytest.approx(
        _cost.collective_time("all-reduce", 5000.0, 8, link)
    )
    acc = _hier(tmp_path / "h", [_ar(2, 1000.0, 2.0, True), _ar(4, 6e5)], 1000.0)
    slow = [c for c in acc["measured"]["collectives"] if c["per_nic"]]
    assert [c["executions"] for c in slow] == [pytest.approx(1.0)]
    # sharded over fast: each owner's branch (one device of a host) sends its own share, the
    # NIC carries each payload once; what runs outside the branches is unchanged
    owners = [_ar(2, 3000.0, 1.0, True), _ar(2, 2000.0, 1.0, True), _ar(2, 4.0), _ar(4, 6e5)]
    sharded = _hier(tmp_path / "h", owners, 5004.0, shard_fast=True)
    assert [c["per_nic"] for c in sharded["measured"]["collectives"]] == [1, 1, 4, 0]
    comm, _ = _network._comm(sharded)
    want = sum(_cost.collective_time("all-reduce", n, 2, link) for n in (3000.0, 2000.0, 16.0))
    assert comm == pytest.approx(want)


def test_a_group_the_mesh_cannot_place_gives_no_prediction(tmp_path):
    """2 x 2 (slow, fast): a group of 2 is either axis, so the model does not guess."""
    _run(tmp_path / "a", 1e8, 0.05)
    lab = json.loads((tmp_path / "a" / _network.LAB_FILE).read_text())
    lab["network"]["devices_per_host"] = 2
    (tmp_path / "a" / _network.LAB_FILE).write_text(json.dumps(lab))
    run = _hier(tmp_path / "a", [_ar(2, 100.0), _ar(2, 5.0)], 100.0,
                mesh=[["slow", 2], ["fast", 2]])  # fmt: skip
    assert _network._comm(run)[0] is None


def test_gzipped_timing_reads_as_the_plain_file(tmp_path):
    import gzip
    import shutil

    w = _run(tmp_path / "r", None, 0.01)
    plain = _network.step_times(w)
    with open(f"{w}/timing.jsonl", "rb") as src, gzip.open(f"{w}/timing.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (tmp_path / "r" / "timing.jsonl").unlink()
    assert _network.step_times(w) == plain
