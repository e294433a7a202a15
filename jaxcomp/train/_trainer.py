"""``train_and_evaluate(config, workdir)``: the training loop shared by every mode.

Sections, in order: Config -> Mesh -> Data -> Model & mode -> Workdir & checkpoint -> Loop ->
Evaluation -> Summary. Everything that can be wrong with the input (config keys, names, the
mesh, the workdir) is checked before the first step is compiled.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from jaxcomp import comm
from jaxcomp import data
from jaxcomp import models
from jaxcomp.train import _checkpoint
from jaxcomp.train import _config
from jaxcomp.train import _metrics
from jaxcomp.train import _mode
from jaxcomp.train import _progress

log = logging.getLogger(__name__)


class TrainState(NamedTuple):
    """Everything saved in a checkpoint's array item."""

    mode_state: Any  # params, optimizer, link / transform states of the mode
    rng: Any  # uint32 key data of the run's base PRNG key


class NonFiniteError(RuntimeError):
    """Raised when too many training steps in a row had a non-finite loss or gradient."""


def _builders() -> dict:
    from jaxcomp.train import _dense

    table = {"dense": _dense.build_dense}
    try:
        from jaxcomp.train import _pipeline_mode

        table["pipeline"] = _pipeline_mode.build_pipeline
    except ImportError:
        pass
    try:
        from jaxcomp.train import _dp_mode

        table["data_parallel"] = _dp_mode.build_data_parallel
    except ImportError:
        pass
    try:
        from jaxcomp.train import _ab_mode

        table["ab"] = _ab_mode.build_ab
    except ImportError:
        pass
    return table


class Setup(NamedTuple):
    """What :func:`setup` builds from a config, before any training step runs."""

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    model: models.StagedModel
    train_loader: data.Loader
    eval_loader: data.Loader
    mode: _mode.Mode


def setup(config: ml_collections.ConfigDict, devices=None) -> Setup:
    """Validates ``config`` and builds the mesh, data, model and mode (compiles the step).

    Raises:
      ValueError: one line naming the problem (unknown key, model, dataset, codec or optimizer,
        a mesh the devices cannot form, ...).
    """
    # --- Config --------------------------------------------------------------------------
    config = _config.with_defaults(config)
    builders = _builders()
    if config.mode not in builders:
        raise ValueError(
            f"mode {config.mode!r} is not available; available modes: {sorted(builders)}."
        )
    # --- Mesh ----------------------------------------------------------------------------
    try:
        mesh = comm.make_mesh([tuple(a) for a in config.mesh], devices=devices)
    except ValueError as e:
        hint = ""
        if devices is None and jax.default_backend() != "cpu":
            hint = " Set JAX_PLATFORMS=cpu to run on fake CPU devices instead."
        raise ValueError(f"config.mesh: {e}{hint}") from e
    # --- Data ----------------------------------------------------------------------------
    train_src = data.get_dataset(config.data_name, "train", **dict(config.data))
    eval_kwargs = {**dict(config.data), **dict(config.eval_data)}
    eval_src = data.get_dataset(config.data_name, "test", **eval_kwargs)
    train_loader = data.Loader(
        train_src, config.batch_size, seed=config.seed, augment=config.augment
    )
    eval_loader = data.Loader(
        eval_src, config.eval_batch_size, seed=config.seed, shuffle=False, drop_last=False
    )
    # --- Model & mode --------------------------------------------------------------------
    model = models.get_model(config.model_name, **dict(config.model))
    mode = builders[config.mode](config, model, mesh, len(train_src))
    return Setup(config, mesh, model, train_loader, eval_loader, mode)


def place(batch: dict, sharding: jax.sharding.NamedSharding) -> dict:
    """Puts host arrays (the same global batch on every process) on the mesh."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items()
    }


def _replicated(x: np.ndarray, mesh) -> jax.Array:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _scalars(tree: dict) -> dict[str, float]:
    out = {}
    for k, v in tree.items():
        a = np.asarray(v.addressable_data(0) if isinstance(v, jax.Array) else v)
        out[k] = float(a) if a.ndim == 0 else a.tolist()
    return out


def evaluate(s: Setup, state: TrainState, compressed: bool) -> dict[str, float]:
    """Mean loss and accuracy over the whole test split."""
    totals: dict[str, float] = {"loss_sum": 0.0, "correct_sum": 0.0, "count": 0.0}
    for batch in s.eval_loader.epoch(0):
        sums = s.mode.eval_step(state.mode_state, place(batch, s.mode.batch_sharding), compressed)
        for k, v in _scalars(sums).items():
            totals[k] += v
    n = max(totals["count"], 1.0)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct_sum"] / n}


def _check_workdir(workdir: str, fp: dict) -> None:
    path = os.path.join(workdir, "experiment.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != fp:
            keys = _config.diff_keys(old, fp)
            raise ValueError(
                f"workdir {workdir!r} holds a checkpoint of another experiment "
                f"(config differs in {keys[:6]}); use a new --workdir."
            )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, devices=None, stop_after: int | None = None
) -> dict[str, Any]:
    """Trains and evaluates ``config`` in ``workdir``, resuming from its latest checkpoint.

    Writes ``metrics.jsonl``, ``train.csv``, ``eval.csv``, ``metrics.png``, ``summary.json``
    and ``summary.txt`` into ``workdir`` (on process 0), and prints progress and the summary.

    Args:
      config: an experiment config (see ``configs/``).
      workdir: the run directory; created if missing.
      devices: devices for the mesh (default: all).
      stop_after: stop (after checkpointing) once this many steps have run in this call; used
        to test resumption.

    Returns:
      The summary: final metrics, bytes per step, wall time.
    """
    t_start = time.perf_counter()
    lead = jax.process_index() == 0
    config = _config.with_defaults(config)
    fp = _config.fingerprint(config)
    os.makedirs(workdir, exist_ok=True)
    _check_workdir(workdir, fp)
    s = setup(config, devices=devices)
    mode, cfg = s.mode, s.config
    say = print if lead else (lambda *a, **k: None)
    say(f"jaxcomp: {cfg.mode} | {mode.description}")
    say(
        f"  model {s.model.name} ({s.model.num_stages} stage(s)), data {cfg.data_name}: "
        f"{s.train_loader.num_examples} train / {s.eval_loader.num_examples} test, "
        f"batch {cfg.batch_size}, {cfg.total_steps} steps, mesh {dict(s.mesh.shape)}"
    )
    wire0 = (
        "reported each step"
        if math.isnan(mode.wire_bytes)
        else _metrics.format_bytes(mode.wire_bytes)
    )
    say(f"  wire bytes/step {wire0} (dense {_metrics.format_bytes(mode.dense_bytes)})")
    if lead:
        with open(os.path.join(workdir, "experiment.json"), "w") as f:
            json.dump(fp, f, indent=1, sort_keys=True)
    # --- Workdir & checkpoint ----------------------------------------------------------------
    ckpt = _checkpoint.Checkpointer(workdir, cfg.keep_checkpoints)
    writer = _metrics.MetricWriter(workdir, enabled=lead)
    # modes place their own state; no ambient mesh (shard_map bodies may seed PRNGs)
    state = TrainState(
        mode.init(jax.random.key(cfg.seed)),
        _replicated(np.asarray(jax.random.key_data(jax.random.key(cfg.seed))), s.mesh),
    )
    meta = {"step": 0, "epoch": 0, "index": 0, "nonfinite_total": 0, "nonfinite_streak": 0}
    restored = ckpt.restore_latest(state)
    if restored is not None:
        step0, state, meta = restored
        if meta.get("fingerprint") not in (None, _config.fingerprint_hash(fp)):
            raise ValueError(f"workdir {workdir!r} holds a checkpoint of another experiment.")
        writer.truncate_after(step0)
        say(f"  resumed from step {step0}")
    step = int(meta["step"])
    data_state = data.LoaderState(int(meta["epoch"]), int(meta["index"]))
    nonfinite_total, streak = int(meta["nonfinite_total"]), int(meta["nonfinite_streak"])
    base_key = jax.random.wrap_key_data(np.asarray(state.rng.addressable_data(0)))

    saved = [int(meta["step"]) if restored is not None else -1]

    def save(at_step):
        if saved[0] == at_step:
            return
        saved[0] = at_step
        m = {
            "step": at_step,
            "epoch": data_state.epoch,
            "index": data_state.index,
            "nonfinite_total": nonfinite_total,
            "nonfinite_streak": streak,
            "fingerprint": _config.fingerprint_hash(fp),
        }
        ckpt.save(at_step, state, m)

    progress = _progress.Progress(cfg.total_steps, step, enabled=lead)
    window: list[dict] = []
    measured: list[float] = []  # wire bytes of this call's steps
    ran = 0
    # --- Loop ----------------------------------------------------------------------------
    while step < cfg.total_steps:
        batch, data_state = s.train_loader.next(data_state)
        key = np.asarray(jax.random.key_data(jax.random.fold_in(base_key, step)))
        state_ms, metrics = mode.train_step(
            state.mode_state, place(batch, mode.batch_sharding), _replicated(key, s.mesh), step
        )
        state = state._replace(mode_state=state_ms)
        step += 1
        ran += 1
        m = _scalars(metrics)
        if m.get("finite", 1.0) < 1.0:
            nonfinite_total += 1
            streak += 1
            progress.message(f"step {step}: non-finite loss or gradient; update skipped.")
            if streak >= cfg.max_nonfinite_in_a_row:
                save(step)
                ckpt.close()
                raise NonFiniteError(
                    f"{streak} training steps in a row had a non-finite loss or gradient "
                    f"(last at step {step}); stopping. Lower the learning rate or check the data."
                )
        else:
            streak = 0
            window.append(m)
            measured.append(m.get("wire_bytes", mode.wire_bytes))
        if step % cfg.log_every == 0 or step == cfg.total_steps:
            avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]} if window else {}
            avg.setdefault("wire_bytes", mode.wire_bytes)  # a mode may report it per step
            avg.update(nonfinite_steps=nonfinite_total, epoch=data_state.epoch)
            writer.write(step, "train", {k: v for k, v in avg.items() if k != "finite"})
            progress.update(step, avg, final=step == cfg.total_steps)
            window = []
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.total_steps:
            _log_eval(s, state, step, writer, progress)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save(step)
        if stop_after is not None and ran >= stop_after:
            save(step)
            ckpt.close()
            return {"stopped_at": step}
    # --- Evaluation & summary ----------------------------------------------------------------
    final = _log_eval(s, state, step, writer, progress)
    save(step)
    ckpt.close()
    wire = float(np.mean(measured)) if measured else mode.wire_bytes
    summary = _summary(s, final, step, nonfinite_total, time.perf_counter() - t_start, wire)
    if lead:
        _write_summary(workdir, summary, s)
    return summary


def _log_eval(s: Setup, state, step, writer, progress) -> dict:
    out = {}
    off = evaluate(s, state, compressed=False)
    if s.mode.has_compressed_eval:
        on = evaluate(s, state, compressed=True)
        out.update(loss=on["loss"], accuracy=on["accuracy"])
        out.update(loss_uncompressed=off["loss"], accuracy_uncompressed=off["accuracy"])
        progress.message(
            f"  eval @ {step}: accuracy {on['accuracy']:.4f} (compression on), "
            f"{off['accuracy']:.4f} (off); loss {on['loss']:.4f} / {off['loss']:.4f}"
        )
    else:
        out.update(loss=off["loss"], accuracy=off["accuracy"])
        progress.message(f"  eval @ {step}: accuracy {off['accuracy']:.4f}, loss {off['loss']:.4f}")
    writer.write(step, "eval", out)
    return out


def _summary(
    s: Setup, final: dict, step: int, nonfinite: int, wall: float, wire: float
) -> dict[str, Any]:
    mode = s.mode
    out = {
        "mode": s.config.mode,
        "model": s.model.name,
        "stages": s.model.num_stages,
        "steps": step,
        "final_loss": final["loss"],
        "final_accuracy": final["accuracy"],
        "wire_bytes_per_step": wire,
        "dense_bytes_per_step": mode.dense_bytes,
        "compression_ratio": mode.dense_bytes / wire if wire else math.inf,
        "nonfinite_steps": nonfinite,
        "wall_time_s": wall,
    }
    if "accuracy_uncompressed" in final:
        out["final_accuracy_uncompressed"] = final["accuracy_uncompressed"]
        out["final_loss_uncompressed"] = final["loss_uncompressed"]
    if s.model.task == "language_model":
        out["final_perplexity"] = math.exp(min(final["loss"], 50.0))
    out.update(mode.extra or {})
    return out


def _write_summary(workdir: str, summary: dict, s: Setup) -> None:
    rows = []
    for k, v in summary.items():
        if "bytes" in k and isinstance(v, (int, float)):
            v = _metrics.format_bytes(v)
        elif k == "wall_time_s":
            v = f"{v:.1f}"
        elif k == "compression_ratio":
            v = f"{v:.1f}x"
        rows.append((k, v))
    table = _metrics.summary_table(rows, title=f"summary: {s.config.mode} / {s.model.name}")
    print(table, flush=True)
    with open(os.path.join(workdir, "summary.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=float)
    png = _metrics.plot_metrics(workdir)
    if png:
        print(f"curves: {png}", flush=True)
