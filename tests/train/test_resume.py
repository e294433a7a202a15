"""A stopped and resumed run is bit-identical to an uninterrupted one, in every mode.

One matrix: each mode (dense, data parallel, pipeline, AB-Training) against one uninterrupted
reference run of the same config, and one run of it interrupted at each point in turn: after
the first step (off the checkpoint grid), in the middle of the run (after step 3), and with
its newest checkpoint damaged (after step 4: the resume falls back to the older one, 3, and
redoes step 4). Every mode's config carries the state a resume must
restore exactly: BatchNorm statistics (per worker, per stage and replica), error-feedback
residuals (per sample on the pipeline's 2 replicas: the loader's per-replica shards), the
adaptive links' and Accordion's detectors and modes (both switch after their first interval),
the AB schedule across a sync, the data loader's position in its epoch, the metrics written so
far and float16's loss scale (the data-parallel and AB configs compute in float16). Compared:
every leaf of the last checkpoint, bit for bit, every metrics record and the summary's final
loss and accuracy. Every run writes TensorBoard events too (the writers are part of the
config a setup is shared by: one setup per mode); those of the interrupted run, read back by
tensorboard's reader, hold every scalar of ``metrics.jsonl`` at the same steps (Accordion's
per-layer modes, AB's phase and per-layer ranks included; step 4's first attempt purged).

The CLI's kill and signals: tests/test_faults.py. Resuming the library's own states (no
trainer): tests/transforms/test_accordion.py, tests/pipeline/test_adaptive_bn.py.
"""

import shutil

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _trainer

#: setups are shared between the runs of a mode (setup is pure): a resumed run computes with
#: the executables of the run it continues, as it does from the persistent compilation cache;
#: each run checks its bits against a run of the same process and compile setting, so the
#: programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles", "shared_setups", "eval_compiled_when_called")

WORKERS, BATCH, STEPS = 4, 16, 5
#: a ResNet of one basic block: a stem and a block, 3 BatchNorms
RESNET = dict(width=4, blocks=(1,), cuts=(), input_shape=(8, 8, 1), norm="batch")
EF = {"name": "top_k", "fraction": 0.25, "feedback": "ef"}


def _config(make_config, mode):
    c = make_config(
        mode=mode, mesh=[("data", WORKERS)], model_name="resnet18", model=dict(RESNET),
        data=dict(flat=False), optax_name="sgd", lr=0.1, batch_size=BATCH,
        eval_batch_size=BATCH, total_steps=STEPS, checkpoint_every=2, log_every=1,
        eval_every=2, writers=("tensorboard",),
    )  # fmt: skip
    if mode == "data_parallel":  # per-worker statistics beside per-worker EF residuals,
        # Accordion's detector switching its per-layer modes, float16's loss scale
        c.data_parallel = dict(
            transform="accordion", low={"name": "top_k", "fraction": 0.25},
            high={"name": "top_k", "fraction": 0.125}, interval_steps=1, check_every=1, eta=10.0,
        )  # fmt: skip
        c.compute_dtype = "float16"
    elif mode == "pipeline":  # 2 replicas of 2 stages, adaptive forward links with EF
        # residuals per sample (the loader's fixed per-replica shards), statistics synchronised
        c.mesh = [("data", 2), ("stage", 2)]  # over the replicas
        c.model = dict(RESNET, cuts=("stem",))
        ef = dict(EF, per_sample_buffers=True)
        c.pipeline = dict(
            num_microbatches=2, forward=ef, forward_high=dict(ef, fraction=0.125),
            detector=dict(interval_steps=1, check_every=1, eta=10.0),
            sync_batch_stats=True, eval_batch_stats="mean",
        )  # fmt: skip
    elif mode == "ab":  # 2 groups of 2: warm-up, factorisation, AB steps, a sync every 2;
        # float16's loss scale
        c.ab = dict(warmup_steps=1, sync_every=2, full_rank_steps=1, group_size=2, inner="sgd")
        c.compute_dtype = "float16"
    return c


#: the dense mode in the fast tier, every mode in the full suite
MODES = (
    "dense",
    *(pytest.param(m, marks=pytest.mark.slow) for m in ("data_parallel", "pipeline", "ab")),
)
#: where the run stops, in turn (each call resumes the one before); the checkpoint of the
#: last stop is damaged before the final call
STOPS = (1, 3, 4)


def _records(workdir):
    return train.read_metrics(str(workdir))


@pytest.fixture(scope="module")
def references(make_config, tmp_path_factory):
    """``references(mode) -> (workdir, summary)``: the uninterrupted run, once per mode;
    ``references.compiled[mode]``: the programs its setup and run compiled, by name (its
    config is this module's only: no other run builds the setup first)."""
    runs = {}

    def get(mode):
        if mode not in runs:
            workdir = tmp_path_factory.mktemp(f"reference_{mode}")
            names = compiled.setdefault(mode, [])

            def listener(event, duration, fun_name=None, **_):
                if event.endswith("backend_compile_duration"):
                    names.append(fun_name)

            jax.monitoring.register_event_duration_secs_listener(listener)
            try:
                summary = train.train_and_evaluate(_config(make_config, mode), str(workdir))
            finally:
                jax.monitoring.unregister_event_duration_listener(listener)
            runs[mode] = workdir, summary
        return runs[mode]

    compiled = {}
    get.compiled = compiled
    return get


def _interrupted(config, workdir, capsys):
    """Runs ``config`` in ``workdir`` stopped at each of :data:`STOPS` and resumed, the newest
    checkpoint damaged before the last resume; returns the finished run's summary."""
    resumed = None
    for stop in STOPS:
        done = train.train_and_evaluate(config, str(workdir), stop_after=stop - (resumed or 0))
        assert done == {"stopped_at": stop}
        out = capsys.readouterr().out
        assert resumed is None or f"resumed from step {resumed}" in out, out
        resumed = stop
    for data in (workdir / "checkpoints" / str(stop)).rglob("d/*"):  # bytes inside each array file
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    summary = train.train_and_evaluate(config, str(workdir))
    out = capsys.readouterr().out
    assert f"checkpoint step {stop}" in out and "damaged" in out, out
    assert f"resumed from step {STOPS[-2]}" in out, out
    return summary


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_is_bit_identical_to_the_uninterrupted_one(
    mode, make_config, references, last_checkpoint, event_files, tmp_path, capsys
):
    full, want = references(mode)
    part = tmp_path / "part"
    config = _config(make_config, mode)
    got = _interrupted(config, part, capsys)
    seen = event_files(part)  # every scalar of metrics.jsonl, the per-layer ones too
    assert seen["summary/final_accuracy"][0][0] == STEPS and "train/step_time_s" in seen
    per_layer = {"data_parallel": "train/layer_mode/", "ab": "train/rank/"}.get(mode)
    assert per_layer is None or any(tag.startswith(per_layer) for tag in seen), seen.keys()
    (s1, a), (s2, b) = last_checkpoint(str(full)), last_checkpoint(str(part))
    assert s1 == s2 == STEPS
    a_leaves, b_leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a_leaves) == len(b_leaves)
    for x, y in zip(a_leaves, b_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    records = _records(full)
    assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4, 5]
    assert _records(part) == records  # no duplicate, missing or different row
    for k in ("final_loss", "final_accuracy", "nonfinite_steps", "wire_bytes_per_step"):
        assert got[k] == want[k], k
    shutil.rmtree(part)


def _batch_stats(state):
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    return [np.asarray(x) for p, x in paths if "batch_stats" in jax.tree_util.keystr(p)]


@pytest.mark.parametrize("mode", MODES)
def test_the_checkpoint_holds_the_state_a_resume_needs(mode, references, last_checkpoint):
    """What the matrix's bit comparison covers, in each mode's last checkpoint."""
    full, summary = references(mode)
    _, state = last_checkpoint(str(full))
    records = [r for r in _records(full) if r["split"] == "train"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert np.isfinite(summary["final_loss"]) and summary["nonfinite_steps"] == 0
    if mode == "pipeline":
        # the running statistics {float32: [S, D, L]}: stage 0 (the stem: one BatchNorm of 4
        # channels, mean and var) and stage 1 (the block: two); SyncBatchNorm: every replica
        # holds the statistics of the microbatch concatenated over the replicas (each its
        # own without the option: tests/pipeline/test_batch_norm.py)
        stats = np.asarray(state["mode_state"]["link_states"][-2])
        assert stats.shape == (2, 2, 16)
        stem = stats[0, :, :8]
        assert not np.allclose(stem[:, :4], 0.0) and not np.allclose(stem[:, 4:], 1.0)
        np.testing.assert_allclose(stats[:, 0], stats[:, 1], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(stats[0, :, 8:], 0.0)  # the stem's padding
        # the detector's first check is critical (low), then every link switches to high
        modes = [r["link_mode_forward_0"] for r in records]
        assert modes[0] == 0 and modes[-1] == 1, modes
        assert records[0]["wire_bytes"] > records[-1]["wire_bytes"]
        # evaluated before step 1 (the trainer's compile ahead) in the low modes, then after
        # the switch: compression on compiled for each, off once (its program is every mode's)
        assert references.compiled[mode].count("jit(eval_step)") == 3, references.compiled
        return
    if mode in ("data_parallel", "ab"):  # float16's loss scale, beside the mode's state
        assert float(state["mode_state"]["loss_scale"]["scale"]) == 2.0**15
        assert int(state["mode_state"]["loss_scale"]["good_steps"]) == STEPS
        modes = [r[k] for r in records for k in r if k.startswith("layer_mode/")]
        assert mode == "ab" or set(modes) == {0.0, 1.0}, modes  # Accordion switched modes
    stats = _batch_stats(state)
    assert len(stats) == 6  # 3 BatchNorms' running means and variances
    assert all(np.isfinite(x).all() for x in stats)
    per_worker = [x.shape[:1] == (WORKERS,) and x.ndim == 2 for x in stats]  # [W, channels]
    assert all(per_worker) if mode in ("data_parallel", "ab") else not any(per_worker)
    if mode == "data_parallel":  # the error-feedback residuals, per worker
        paths = jax.tree_util.tree_flatten_with_path(state)[0]
        residuals = [x for p, x in paths if "residual" in jax.tree_util.keystr(p)]
        assert residuals and all(np.shape(x)[0] == WORKERS for x in residuals)
        assert any(np.any(np.asarray(x) != 0) for x in residuals)


@pytest.mark.slow
def test_a_run_resumed_from_before_the_per_layer_rename_has_the_uninterrupted_records(
    make_config, references, monkeypatch, tmp_path, capsys
):
    """Steps 1-3 written as the version before the rename did (``layer_mode/0/<name>``: the
    one-stage model's index in the name), resumed by this one: one spelling, the uninterrupted
    run's records (the window's renames: tests/train/test_writers.py)."""
    full, _ = references("data_parallel")
    config = _config(make_config, "data_parallel")
    scalars = _trainer._scalars

    def old_names(tree):
        return {k.replace("layer_mode/", "layer_mode/0/"): v for k, v in scalars(tree).items()}

    monkeypatch.setattr(_trainer, "_scalars", old_names)
    assert train.train_and_evaluate(config, str(tmp_path), stop_after=3) == {"stopped_at": 3}
    assert any(k.startswith("layer_mode/0/") for k in _records(tmp_path)[0])
    monkeypatch.undo()
    train.train_and_evaluate(config, str(tmp_path))
    assert _records(tmp_path) == _records(full)
