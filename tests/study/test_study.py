"""Studies: the grid of cells, the resumable runner and the report, on a fake trainer (fast)."""

import csv
import functools
import json
import os
import textwrap

import ml_collections
import pytest

from jaxcomp import _stamp
from jaxcomp import study
from jaxcomp.study import _report
from jaxcomp.study import _write

_STAMP = functools.cache(_stamp.stamp)


@pytest.fixture(autouse=True)
def _stamped_once(monkeypatch):
    """Every cell records the process's one stamp: ``git`` ran twice per cell of each fake
    study (~0.05 s of child CPU per test; the stamp is the same within a test process)."""
    monkeypatch.setattr(_stamp, "stamp", _STAMP)


STUDY_FILE = '''
r"""A tiny test study.

  python -m jaxcomp.study run tiny --workdir runs/tiny
"""

CONFIG = "digits_pipeline"
COMMON = {"total_steps": 10}
VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward": "identity"},
    "topk 10%": {"pipeline.forward": {"name": "top_k", "fraction": 0.1}},
}
AXES = {"optimizer": {"adam": {"optax_name": "adam"}, "sgd": {"optax_name": "sgd", "lr": 0.05}}}
SEEDS = (0, 1)
BASELINE = "dense"
'''


def write_study(folder, text=STUDY_FILE, name="tiny"):
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def tiny(tmp_path):
    return study.load_study(str(write_study(tmp_path)))


class NonFiniteError(RuntimeError):
    """Stands in for jaxcomp.train.NonFiniteError (matched by name)."""


ACCURACY = {"identity": 0.9, "top_k": 0.8}
BOUNDARY = {"identity": 2400.0, "top_k": 240.0}


def fake_train(calls, fail=(), diverge=()):
    """A trainer that writes what jaxcomp.train writes, with numbers set by the config."""

    def train_fn(config, workdir):
        name = os.path.basename(workdir)
        calls.append(name)
        if any(f in name for f in diverge):
            raise NonFiniteError("10 steps in a row non-finite")
        if any(f in name for f in fail):
            raise RuntimeError("device lost")
        fwd = config.pipeline.forward
        codec = fwd if isinstance(fwd, str) else fwd["name"]
        acc = ACCURACY[codec] + 0.02 * config.seed + (0.0 if config.optax_name == "adam" else -0.1)
        with open(os.path.join(workdir, "experiment.json"), "w") as f:
            json.dump({"mesh": [["data", 2], ["stage", 4]]}, f)
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            for step, a in ((5, acc + 0.05), (10, acc)):
                f.write(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n")
                rec = {"accuracy": a, "accuracy_uncompressed": a + 0.01, "loss": 1 - a}
                f.write(json.dumps({"step": step, "split": "eval", **rec}) + "\n")
        summary = {
            "mode": "pipeline",
            "stages": 4,
            "microbatches": 4,
            "steps": config.total_steps,
            "final_loss": 1 - acc,
            "final_accuracy": acc,
            "final_accuracy_uncompressed": acc + 0.01,
            "wire_bytes_per_step": BOUNDARY[codec],
            "dense_bytes_per_step": 2400.0,
            "boundary_bytes_per_step": BOUNDARY[codec],
            "hlo_collective_bytes_per_step": BOUNDARY[codec] + 1000.0,
            "wall_time_s": 1.0 + config.seed,
        }
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f)
        return summary

    return train_fn


# --- the grid ---------------------------------------------------------------------------------


def test_cells_cross_variants_axes_and_seeds_in_order(tiny):
    cells = study.cells(tiny)
    assert [c.name for c in cells[:4]] == [
        "dense__optimizer=adam__seed0",
        "dense__optimizer=adam__seed1",
        "dense__optimizer=sgd__seed0",
        "dense__optimizer=sgd__seed1",
    ]
    assert len(cells) == 8 and cells[4].name == "topk-10__optimizer=adam__seed0"
    sgd = cells[6]
    assert sgd.overrides == {
        "total_steps": 10,
        "pipeline.forward": {"name": "top_k", "fraction": 0.1},
        "optax_name": "sgd",
        "lr": 0.05,
        "seed": 0,
    }
    config = study.cell_config(tiny, sgd)
    assert (config.optax_name, config.lr, config.seed, config.total_steps) == ("sgd", 0.05, 0, 10)
    assert config.pipeline.forward.to_dict() == {"name": "top_k", "fraction": 0.1}
    smoke = study.cells(tiny, study.SMOKE)[0].overrides
    assert smoke["total_steps"] == 2 and smoke["eval_every"] == 0


def test_direction_presets_are_plain_override_dicts():
    p = study.direction_presets({"name": "top_k", "fraction": 0.1})
    assert p["forward-only"] == {
        "pipeline.forward": {"name": "top_k", "fraction": 0.1},
        "pipeline.backward": "identity",
    }
    assert p["both"]["pipeline.backward"] == p["both"]["pipeline.forward"]
    assert p["backward-only"]["pipeline.forward"] == "identity"


@pytest.mark.parametrize(
    "change, error",
    [
        (("CONFIG = ", "XCONFIG = "), "defines no CONFIG"),
        (("VARIANTS = {", "VARIANTS = {}\nOLD = {"), "VARIANTS is empty"),
        (("SEEDS = (0, 1)", "SEEDS = (0, 0)"), "SEEDS has duplicates"),
        (("SEEDS = (0, 1)", "SEEDS = (0.5,)"), "SEEDS must be a non-empty tuple of ints"),
        (('BASELINE = "dense"', 'BASELINE = "none"'), "BASELINE 'none' is not a variant"),
        (('"adam": {"optax_name": "adam"}', '"adam": "adam"'), r"AXES\['optimizer'\]\['adam'\]"),
        (("python -m jaxcomp.study run", "python -m run"), "docstring must give the command"),
        (('"topk 10%"', '"dense!"'), "share the name 'dense__optimizer=adam__seed0'"),
    ],
)
def test_malformed_study_files_are_clear_errors(tmp_path, change, error):
    text = STUDY_FILE.replace(*change)
    assert text != STUDY_FILE
    with pytest.raises(ValueError, match=error):
        study.cells(study.load_study(str(write_study(tmp_path, text))))


def test_unknown_study_and_bad_override_name_the_problem(tmp_path, tiny):
    with pytest.raises(ValueError, match="unknown study 'nope'.*known: \\['tiny'\\]"):
        study.load_study("nope", studies_dir=tmp_path)
    bad = study.cells(tiny, {"pipeline.forwrd": "identity"})[0]
    with pytest.raises(ValueError, match="cell dense__optimizer=adam__seed0: unknown config key"):
        study.cell_config(tiny, bad)


def test_a_typo_in_any_cell_fails_before_the_first_run(tmp_path):
    text = STUDY_FILE.replace('"lr": 0.05', '"lr": "fast"')
    calls = []
    with pytest.raises(ValueError, match="config.lr must be a number"):
        study.run_study(study.load_study(str(write_study(tmp_path, text))), str(tmp_path / "w"),
                        train_fn=fake_train(calls), log=lambda *_: None)  # fmt: skip
    assert calls == []


# --- the runner -------------------------------------------------------------------------------


def test_runner_records_statuses_and_a_rerun_continues(tiny, tmp_path):
    workdir, calls = str(tmp_path / "w"), []
    train_fn = fake_train(calls, fail=("sgd__seed1",), diverge=("topk-10__optimizer=adam__seed0",))
    statuses = study.run_study(tiny, workdir, train_fn=train_fn, log=lambda *_: None)
    assert len(calls) == 8
    assert statuses["dense__optimizer=adam__seed0"] == "done"
    assert statuses["topk-10__optimizer=adam__seed0"] == "diverged"
    assert [k for k, v in statuses.items() if v == "failed"] == [
        "dense__optimizer=sgd__seed1",
        "topk-10__optimizer=sgd__seed1",
    ]
    cell = json.load(open(os.path.join(workdir, "dense__optimizer=sgd__seed1", "cell.json")))
    assert cell["status"] == "failed" and cell["error"] == "RuntimeError: device lost"
    # the rerun retries the failed cells only (diverged ones are a result, not retried)
    calls.clear()
    statuses = study.run_study(tiny, workdir, train_fn=fake_train(calls), log=lambda *_: None)
    assert calls == ["dense__optimizer=sgd__seed1", "topk-10__optimizer=sgd__seed1"]
    assert list(statuses.values()).count("done") == 7


def test_a_killed_cell_is_run_again(tiny, tmp_path):
    workdir, calls = str(tmp_path / "w"), []

    def killed(config, workdir):
        calls.append(os.path.basename(workdir))
        if len(calls) == 3:
            raise KeyboardInterrupt  # a signal: not recorded as failed, the study stops

    with pytest.raises(KeyboardInterrupt):
        study.run_study(tiny, workdir, train_fn=killed, log=lambda *_: None)
    cell = json.load(open(os.path.join(workdir, calls[-1], "cell.json")))
    assert cell["status"] == "running"
    calls2 = []
    study.run_study(tiny, workdir, train_fn=fake_train(calls2), log=lambda *_: None)
    assert calls2 == [c.name for c in study.cells(tiny)][2:]


def test_a_workdir_holds_one_study_smoke_or_not(tiny, tmp_path):
    workdir = str(tmp_path / "w")
    study.run_study(tiny, workdir, smoke=True, train_fn=fake_train([]), log=lambda *_: None)
    with pytest.raises(ValueError, match="smoke=True.*use another --workdir"):
        study.run_study(tiny, workdir, train_fn=fake_train([]), log=lambda *_: None)
    with pytest.raises(ValueError, match="extra=.*use another --workdir"):
        study.run_study(tiny, workdir, smoke=True, extra={"lr": 0.5}, train_fn=fake_train([]),
                        log=lambda *_: None)  # fmt: skip
    changed = study.load_study(str(write_study(tmp_path, STUDY_FILE.replace("0.05", "0.06"))))
    with pytest.raises(ValueError, match="cell 'dense__optimizer=sgd__seed0' of .* changed"):
        study.run_study(changed, workdir, smoke=True, train_fn=fake_train([]), log=lambda *_: None)


# --- the report -------------------------------------------------------------------------------


@pytest.fixture
def finished(tiny, tmp_path):
    workdir = str(tmp_path / "w")
    train_fn = fake_train([], diverge=("topk-10__optimizer=sgd__seed1",))
    study.run_study(tiny, workdir, train_fn=train_fn, log=lambda *_: None)
    return workdir


def test_report_aggregates_seeds_and_predicts_speedups_by_hand(finished):
    manifest, runs = study.read_runs(finished)
    links = {1.0: study.NetworkLink(bandwidth=1000.0, latency=0.0)}
    rows, notes = study.aggregate(manifest, runs, compute_s=0.01, links=links)
    by = {(r["variant"], r["optimizer"]): r for r in rows}
    dense = by[("dense", "adam")]
    assert dense["seeds"] == 2 and dense["diverged"] == 0
    assert dense["final_acc_on"] == pytest.approx(0.91)  # 0.9 and 0.92
    assert dense["final_acc_on_std"] == pytest.approx(0.0141421, rel=1e-4)
    assert dense["final_acc_off"] == pytest.approx(0.92)
    assert dense["best_acc_on"] == pytest.approx(0.96)  # best evaluation: 0.95 and 0.97
    assert dense["x_fewer_than_dense"] == pytest.approx(1.0) and dense["axis"] == "stage"
    topk = by[("topk 10%", "adam")]
    assert topk["x_fewer_than_baseline"] == pytest.approx(10.0)
    # 24 single-pair permutes of the boundary bytes, then the rest (1000 B) as an all-reduce
    # over the 2 data replicas: dense 0.01 + 2.4 + 1.0, TopK 0.01 + 0.24 + 1.0
    assert dense["speedup_1gbit"] == pytest.approx(1.0)
    assert topk["speedup_1gbit"] == pytest.approx(3.41 / 1.25)
    sgd = by[("topk 10%", "sgd")]
    assert (sgd["seeds"], sgd["of_seeds"], sgd["diverged"]) == (1, 2, 1)
    assert sgd["final_acc_on"] == pytest.approx(0.7)  # the diverged seed is not averaged
    assert any("boundary permutes" in n for n in notes)


@pytest.mark.parametrize("compute_s", [-0.01, float("nan"), float("inf"), "fast"])
def test_report_rejects_a_bad_compute_s_naming_it(finished, compute_s):
    manifest, runs = study.read_runs(finished)
    links = {1.0: study.NetworkLink(bandwidth=1000.0, latency=0.0)}
    with pytest.raises(ValueError, match="compute_s"):
        study.aggregate(manifest, runs, compute_s=compute_s, links=links)


def test_report_writes_markdown_csv_and_plots(finished):
    paths = study.write_report(finished, compute_s=0.01)
    md = open(paths["markdown"]).read()
    assert md.startswith("# Study `tiny`")
    assert "| topk 10% | sgd | 1/2 | 1 |" in md
    assert "0.910 ± 0.014" in md and "10.00x" in md
    # bytes per kind: the boundary permutes and the rest as the data axis's all-reduce
    assert "| variant | optimizer | all-reduce/2 | collective-permute/2 |" in md
    assert "| topk 10% | adam | 1000 B | 240 B |" in md
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and float(rows[0]["final_acc_on"]) == pytest.approx(0.91)
    with open(paths["cells_csv"]) as f:
        cells = list(csv.DictReader(f))
    assert len(cells) == 8 and {c["status"] for c in cells} == {"done", "diverged"}
    for name in ("accuracy_vs_bytes", "curves"):
        assert open(paths[name], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "state" not in paths  # no Accordion / AB metrics in these runs


def _run(summary):
    return _report.Run("cell", "variant", {}, 0, "done", summary, [], [], {})


def test_a_language_models_perplexity_is_reported_on_and_off():
    lm = {"final_loss": 2.0, "final_accuracy": 0.4, "final_accuracy_uncompressed": 0.3,
          "final_perplexity": 7.389, "final_perplexity_uncompressed": 9.0}  # fmt: skip
    m = _report.run_metrics(_run(lm))
    assert (m["final_ppl_on"], m["final_ppl_off"]) == (7.389, 9.0)
    dense = _report.run_metrics(_run({"final_loss": 2.0, "final_perplexity": 7.389}))
    assert (dense["final_ppl_on"], dense["final_ppl_off"]) == (None, 7.389)
    assert _report.run_metrics(_run({"final_loss": 0.1}))["final_ppl_off"] is None  # digits
    row = {k: None for k in (*_report.METRICS, *(f"{k}_std" for k in _report.METRICS))}
    row.update(variant="v", seeds=2, of_seeds=2, unfinished=0, diverged=0, axis="stage",
               x_fewer_than_dense=None, x_fewer_than_baseline=None)  # fmt: skip
    lm_row = {**row, "final_ppl_on": 7.389, "final_ppl_off": 9.0, "final_ppl_off_std": 0.5}
    table = _write.markdown_table([lm_row], [], [1.0])
    assert "| final ppl (on) | final ppl (off) | final loss |" in table
    assert "| 7.389 | 9.000 ± 0.500 |" in table
    assert "final ppl" not in _write.markdown_table([row], [], [1.0])


def _record(kind, nbytes, executions, conditional):
    return {"kind": kind, "group_size": 8, "bytes_per_execution": nbytes,
            "executions": executions, "conditional": conditional}  # fmt: skip


def test_collectives_in_branches_are_scaled_to_the_runs_mean_bytes():
    # a 100 B all-reduce every step; two 50 B branches (each counted once in the HLO)
    recs = [_record("all-reduce", 100.0, 1.0, False), _record("all-gather", 50.0, 2.0, True)]
    colls, how = _report.collectives_of(_run({"collectives": recs, "wire_bytes_per_step": 150.0}))
    assert [(c.kind, c.executions) for c in colls] == [("all-reduce", 1.0), ("all-gather", 1.0)]
    assert "scaled to the run's mean bytes" in how
    assert _report.bytes_by_kind(colls) == {"all-reduce/8": 100.0, "all-gather/8": 50.0}
    lk = study.NetworkLink(bandwidth=1000.0, latency=0.0)  # by hand: 2*7/8*0.1 + 7*0.05
    assert study.communication_time(colls, lk) == pytest.approx(0.525)
    # a step whose branches never ran (the mean is the fixed part): none of them counted
    colls, _ = _report.collectives_of(_run({"collectives": recs, "wire_bytes_per_step": 80.0}))
    assert [c.executions for c in colls] == [1.0, 0.0]
    # a straight program is taken as measured, whatever the mean
    colls, how = _report.collectives_of(_run({"collectives": recs[:1], "wire_bytes_per_step": 7}))
    assert colls == [study.Collective("all-reduce", 100.0, 8, 1.0)] and "branches" not in how
    colls, how = _report.collectives_of(_run({"collectives": recs, "wire_bytes_per_step": None}))
    assert colls is None and "no finite mean bytes" in how
    with pytest.raises(ValueError, match="collectives are damaged"):
        _report.collectives_of(_run({"collectives": [{"kind": "all-reduce"}]}))


def test_adaptive_pipeline_links_are_priced_at_the_runs_mean_boundary_bytes():
    # figures of a digits run (data 2 x stage 4, M=4): low links 104,496 B, high 55,344 B,
    # the data-axis gradient mean the low program's HLO total minus its boundary
    summary = {"mode": "pipeline", "microbatches": 4, "stages": 4,
               "boundary_bytes_per_step": 104496.0, "hlo_collective_bytes_per_step": 707754.0,
               "adaptive": "interval 11 steps, every 2, eta=0.5",
               "boundary_bytes_per_step_high": 55344.0}  # fmt: skip
    mean = {**summary, "wire_bytes_per_step": 62552.96}
    run = _report.Run(
        "cell", "adaptive", {}, 0, "done", mean, [], [], {"mesh": [["data", 2], ["stage", 4]]}
    )
    colls, how = _report.collectives_of(run)
    by_kind = _report.bytes_by_kind(colls)
    assert by_kind["collective-permute/2"] == pytest.approx(62552.96)  # the measured mean
    assert by_kind["all-reduce/2"] == pytest.approx(707754.0 - 104496.0)
    assert "mean boundary bytes" in how
    # a fixed-link run is priced at its compiled boundary bytes
    fixed = {k: v for k, v in summary.items() if "adaptive" not in k and "_high" not in k}
    colls, _ = _report.collectives_of(
        run._replace(summary={**fixed, "wire_bytes_per_step": 104496.0})
    )
    assert _report.bytes_by_kind(colls)["collective-permute/2"] == pytest.approx(104496.0)
    # an adaptive run without a finite mean cannot be priced: no silent low-link figure
    colls, how = _report.collectives_of(
        run._replace(summary={**summary, "wire_bytes_per_step": None})
    )
    assert colls is None and "adaptive" in how


@pytest.mark.parametrize("permutes, count", [(None, 24), (12, 12), (-1, None), ("x", None)])
def test_a_pipeline_run_counts_the_permutes_it_ran_with_its_bytes_exact(permutes, count):
    """GPipe 4 x 4: 24 boundary sends; a run of one permute per tick and direction records
    12 permutes (each carrying every sending boundary's pair); a damaged count is refused."""
    boundary = 24 * 32768.0
    summary = {"mode": "pipeline", "microbatches": 4, "stages": 4,
               "boundary_bytes_per_step": boundary,
               "hlo_collective_bytes_per_step": boundary}  # fmt: skip
    if permutes is not None:
        summary["permutes_per_step"] = permutes
    run = _report.Run("cell", "p", {}, 0, "done", summary, [], [], {"mesh": [["stage", 4]]})
    if count is None:
        with pytest.raises(ValueError, match="permutes_per_step is damaged"):
            _report.collectives_of(run)
        return
    colls, _ = _report.collectives_of(run)
    assert sum(c.executions for c in colls) == count
    assert _report.bytes_by_kind(colls) == {"collective-permute/2": pytest.approx(boundary)}


def test_each_cost_model_note_names_the_variants_it_prices():
    # a fixed and an adaptive pipeline variant are priced two ways: one note per way, naming
    # its variants (two unlabelled "collectives for the cost model" lines were ambiguous)
    summary = {"mode": "pipeline", "microbatches": 4, "stages": 4, "final_loss": 0.1,
               "boundary_bytes_per_step": 104496.0, "hlo_collective_bytes_per_step": 707754.0,
               "wire_bytes_per_step": 104496.0, "wall_time_s": 1.0, "steps": 10}  # fmt: skip
    adaptive = {**summary, "adaptive": "interval 11 steps", "wire_bytes_per_step": 62552.96}
    runs = [
        _report.Run(f"{v}-{i}", v, {}, i, "done", s, [], [], {"mesh": [["stage", 4]]})
        for v, s in (("fixed", summary), ("adaptive", adaptive))
        for i in range(2)
    ]
    _, notes = study.aggregate({"axes": [], "baseline": "fixed"}, runs, compute_s=0.01)
    cost = [n for n in notes if n.startswith("collectives for the cost model")]
    assert cost == [
        "collectives for the cost model (adaptive): boundary permutes (the run's mean boundary "
        "bytes) + data-axis all-reduce of the rest of the HLO bytes.",
        "collectives for the cost model (fixed): boundary permutes + data-axis all-reduce of "
        "the rest of the HLO bytes.",
    ]


def test_report_state_plot_for_adaptive_methods(finished):
    cell = os.path.join(finished, "dense__optimizer=adam__seed0", "metrics.jsonl")
    with open(cell, "a") as f:
        for step in (11, 12):
            rec = {"step": step, "split": "train", "loss": 0.1, "phase": step % 2,
                   "mean_rank": 3.0, "wire_bytes": 10.0}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    assert open(study.write_report(finished)["state"], "rb").read(4) == b"\x89PNG"


def test_report_reads_a_killed_run_and_rejects_damaged_files(finished, tmp_path):
    cell = os.path.join(finished, "dense__optimizer=adam__seed0", "metrics.jsonl")
    with open(cell, "a") as f:
        f.write('{"step": 11, "split": "ev')  # killed mid-write: the last line is dropped
    _, runs = study.read_runs(finished)
    assert len(runs[0].evals) == 2
    with open(cell, "a") as f:
        f.write("\n" + json.dumps({"step": 12, "split": "train"}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl line 5 is damaged"):
        study.read_runs(finished)
    with pytest.raises(ValueError, match="holds no study"):
        study.write_report(str(tmp_path / "empty"))
    with open(os.path.join(finished, "study.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match="study.json is damaged"):
        study.read_runs(finished)


def test_report_of_an_unfinished_study(tiny, tmp_path):
    workdir = str(tmp_path / "w")
    calls = []

    def stop_after_two(config, workdir):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake_train(calls)(config, workdir)

    with pytest.raises(KeyboardInterrupt):
        study.run_study(tiny, workdir, train_fn=stop_after_two, log=lambda *_: None)
    manifest, runs = study.read_runs(workdir)
    rows, _ = study.aggregate(manifest, runs)
    first = rows[0]
    assert (first["seeds"], first["unfinished"]) == (2, 0)
    assert rows[1]["seeds"] == 0 and rows[1]["unfinished"] == 2
    assert rows[1]["final_acc_on"] is None and rows[1]["speedup_1gbit"] is None
    md = open(study.write_report(workdir)["markdown"]).read()
    assert "2 of 8 runs done, 0 diverged" in md and "| dense | sgd | 0/2 (2 unfinished) |" in md


# --- presets and cell selection ---------------------------------------------------------------

TOPK = {"name": "top_k", "fraction": 0.1}


@pytest.mark.parametrize(
    "forward, backward, preset, expected",
    [
        (TOPK, "identity", "backward-only",
         {"pipeline.forward": "identity", "pipeline.backward": TOPK}),
        ("identity", TOPK, "both", {"pipeline.forward": TOPK, "pipeline.backward": TOPK}),
        (TOPK, {"name": "quantize", "bits": 8}, "forward-only",
         {"pipeline.forward": TOPK, "pipeline.backward": "identity"}),
        ("identity", "identity", "both", {}),  # an uncompressed baseline stays one
        ({"name": "identity"}, "identity", "forward-only", {}),
    ],
)  # fmt: skip
def test_preset_moves_the_cells_codec_to_the_named_directions(forward, backward, preset, expected):
    config = ml_collections.ConfigDict(
        {"mode": "pipeline", "pipeline": {"forward": forward, "backward": backward}}
    )
    assert study.preset_overrides(config, preset) == expected


@pytest.mark.parametrize(
    "config, preset, error",
    [
        ({"mode": "pipeline", "pipeline": {}}, "forward", "unknown preset 'forward'"),
        ({"mode": "data_parallel"}, "both", "needs mode 'pipeline'; got 'data_parallel'"),
        ({"mode": "pipeline", "pipeline": {"boundaries": [{}]}}, "both", "per-boundary codecs"),
    ],
)
def test_preset_errors_name_the_problem(config, preset, error):
    with pytest.raises(ValueError, match=error):
        study.preset_overrides(ml_collections.ConfigDict(config), preset)


def test_select_keeps_grid_order_and_rejects_a_pattern_matching_nothing(tiny):
    grid = study.cells(tiny)
    chosen = study.select(grid, ["topk*seed1", "dense__optimizer=adam__seed0"])
    assert [c.name for c in chosen] == [
        "dense__optimizer=adam__seed0",
        "topk-10__optimizer=adam__seed1",
        "topk-10__optimizer=sgd__seed1",
    ]
    assert study.select(grid, []) == grid
    with pytest.raises(ValueError, match=r"--cells 'sign\*' matches no cell"):
        study.select(grid, ["sign*"])


def test_run_study_with_cells_and_a_preset(tiny, tmp_path):
    workdir, calls, configs = str(tmp_path / "w"), [], {}
    inner = fake_train(calls)

    def train_fn(config, cell_dir):
        configs[os.path.basename(cell_dir)] = config
        return inner(config, cell_dir)

    statuses = study.run_study(tiny, workdir, preset="backward-only", only=["*adam__seed0"],
                               train_fn=train_fn, log=lambda *_: None)  # fmt: skip
    assert calls == ["dense__optimizer=adam__seed0", "topk-10__optimizer=adam__seed0"]
    assert set(statuses) == set(calls)
    topk = configs["topk-10__optimizer=adam__seed0"].pipeline
    assert (topk.forward, topk.backward.to_dict()) == ("identity", TOPK)
    assert configs["dense__optimizer=adam__seed0"].pipeline.backward == "identity"
    manifest = json.load(open(os.path.join(workdir, "study.json")))
    assert manifest["preset"] == "backward-only" and len(manifest["cells"]) == 8
    md_path = study.write_report(workdir)["markdown"]
    assert "2 of 8 runs done" in open(md_path).read()  # the others show as missing
    with pytest.raises(ValueError, match="preset=backward-only.*preset=None.*another --workdir"):
        study.run_study(tiny, workdir, train_fn=train_fn, log=lambda *_: None)
