"""Benchmarks run at a tiny size and write their keys; the shared timing harness pairs samples."""

import json

import jax.numpy as jnp
import pytest

from jaxcomp.bench import _common
from jaxcomp.bench import compressors as compressors_bench

#: the benchmarks run here for their keys and the harness's pairing, not for their times: their
#: programs (the AB trainer's step kinds at two sizes above all) are compiled unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

COMPRESSOR_KEYS = {
    "name", "payload_bytes", "hlo_bytes", "time_s", "copy_time_s", "time_q1_s", "time_q3_s",
    "encode_s", "decode_s", "ratio_to_copy", "ratio_q1", "ratio_q3",
}  # fmt: skip


def test_round_robin_runs_the_baseline_before_every_candidate_sample():
    calls = []

    def tag(name):
        def fn(x):
            calls.append(name)
            return x

        return fn

    x = jnp.ones(3)
    base, timed = _common.round_robin(
        [(tag("b"), (x,))], [[(tag("c0"), (x,))], [(tag("c1"), (x,)), (tag("c1"), (x,))]], 4, 1
    )
    assert len(base.samples) == 8 and [len(t.samples) for t in timed] == [4, 4]
    assert [len(p) for p in timed[1].parts] == [4, 4]
    timed_calls = calls[4:]  # after the warm-up: baseline, c0, c1, c1
    starts = [i for i, c in enumerate(timed_calls) if c != "b" and timed_calls[i - 1] == "b"]
    assert len(starts) == 8  # every candidate sample comes right after a baseline call
    assert sorted(timed[0].baseline + timed[1].baseline) == sorted(base.samples)
    stats = timed[0].stats()
    assert stats["time_q1_s"] <= stats["time_s"] <= stats["time_q3_s"]
    assert stats["ratio_q1"] <= stats["ratio_q3"]


@pytest.mark.slow
def test_compressors_benchmark_writes_its_keys(tmp_path):
    path = tmp_path / "compressors.json"
    only = "identity,quant3,quant4_feature,topk1%_exact,topk1%_blockwise"
    args = ["--n", "16384", "--repeats", "2", "--only", only, "--json", str(path)]
    assert compressors_bench.main(args) == 0
    data = json.loads(path.read_text())
    assert data["benchmark"] == "compressors"
    assert [r["name"] for r in data["results"]] == only.split(",")
    assert len(data["load_before"]) == 3 and data["copy_time_s"] > 0
    for r in data["results"]:
        assert COMPRESSOR_KEYS <= r.keys(), r["name"]
        assert r["hlo_bytes"] == r["payload_bytes"], r["name"]
        assert r["time_q1_s"] <= r["time_s"] <= r["time_q3_s"], r["name"]
        assert r["copy_time_s"] == data["copy_time_s"]  # one shared baseline
    assert data["self_ratio_q1"] <= data["self_ratio_q3"] and data["self_ratio"] > 0


def test_print_table_without_rows_prints_the_header(capsys):
    """``pipeline --only LABEL`` matching no link leaves the link table empty (this raised)."""
    _common.print_table([], [("codec", "s"), ("step_time_s", ".4f")])
    assert capsys.readouterr().out.split() == ["codec", "step_time_s"]
    _common.print_table(
        [{"codec": "q8", "step_time_s": None}], [("codec", "s"), ("step_time_s", ".4f")]
    )
    assert capsys.readouterr().out.split() == ["codec", "step_time_s", "q8", "-"]


def test_peers_without_torch_is_skipped_with_a_message(capsys):
    """``bench peers`` needs the optional torch extra; without it, a message and exit 0."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here; the skip path is not reachable")
    from jaxcomp.bench import peers

    assert peers.main(["--repeats", "1"]) == 0
    assert "skipped, torch is not installed" in capsys.readouterr().out


@pytest.mark.slow  # torch's spawned ranks and two jaxcomp compiles: ~29 s where torch is installed
def test_peers_ddp_step_matches_torch_shapes_when_torch_is_installed():
    """The DDP rows run end to end (2 gloo ranks) and report positive times for both sides."""
    pytest.importorskip("torch")
    from jaxcomp.bench import _peers_ddp

    rows = _peers_ddp.run(repeats=2, warmup=2)
    assert [r["name"] for r in rows] == ["ddp_dense", "ddp_powersgd_r2"]
    for r in rows:
        assert r["jax_time_s"] > 0 and r["torch_time_s"] > 0
        assert r["jax_q1_s"] <= r["jax_time_s"] <= r["jax_q3_s"]


@pytest.mark.parametrize("rows", [0, -16, 2.5, True, "16"])
def test_ab_training_rows_per_worker_must_be_a_positive_int(rows):
    from jaxcomp.bench import ab_training

    with pytest.raises(ValueError, match="rows_per_worker must be a positive int"):
        ab_training.time_kinds(1, rows)


@pytest.mark.slow
def test_ab_training_benchmark_times_each_rows_per_worker_and_keeps_its_keys(tmp_path, monkeypatch):
    from jaxcomp.bench import ab_training

    path = tmp_path / "ab.json"
    argv = ["--no-bytes", "--repeats", "1", "--rows-per-worker", "4", "--json", str(path)]
    assert ab_training.main(argv) == 0
    results = json.loads(path.read_text())["results"]
    phases = ["full", "refactor", "ab", "sync", "ab_dense_forward", "ab_switch", "full_checked"]
    assert [(r["rows_per_worker"], r["phase"]) for r in results] == [(4, p) for p in phases]
    for r in results:
        keys = ("model", "phase", "hlo_bytes_per_step", "dp_hlo_bytes_per_step", "step_time_s")
        assert all(r[k] is not None for k in (*keys, "dense_step_time_s"))
        assert r["step_time_s"] > 0 and r["dense_step_time_s"] > 0
    # every --rows-per-worker value is timed, in order (each size compiles its own programs:
    # the timing above is the real one, here its records stand in for each size's)
    calls = []

    def time_kinds(repeats, rows):
        calls.append((repeats, rows))
        return [dict(r, rows_per_worker=rows) for r in results]

    monkeypatch.setattr(ab_training, "time_kinds", time_kinds)
    argv = ["--no-bytes", "--repeats", "1", "--rows-per-worker", "1", "4", "--json", str(path)]
    assert ab_training.main(argv) == 0
    assert calls == [(1, 1), (1, 4)]
    both = json.loads(path.read_text())["results"]
    assert [(r["rows_per_worker"], r["phase"]) for r in both] == [
        (rows, phase) for rows in (1, 4) for phase in phases
    ]
