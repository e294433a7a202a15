"""``train_and_evaluate(config, workdir)``: the training loop shared by every mode.

Sections, in order: Config & workdir -> Mesh -> Data -> Model & mode -> Checkpoint -> Loop ->
Evaluation -> Summary. Everything that can be wrong with the input (config keys, names, the
mesh, the workdir) is checked before the first step runs and raised as a one-line
:class:`SetupError`; what goes wrong later keeps its traceback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import logging
import math
import time
from typing import Any
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from jaxcomp import _fetch
from jaxcomp import comm
from jaxcomp import data
from jaxcomp import models
from jaxcomp.train import _checkpoint
from jaxcomp.train import _cold_sends
from jaxcomp.train import _config
from jaxcomp.train import _link_probe
from jaxcomp.train import _lock
from jaxcomp.train import _metrics
from jaxcomp.train import _mode
from jaxcomp.train import _precision
from jaxcomp.train import _processes
from jaxcomp.train import _progress
from jaxcomp.train import _signals
from jaxcomp.train import _watchdog
from jaxcomp.train import _workdir
from jaxcomp.train._errors import Interrupted
from jaxcomp.train._errors import NonFiniteError
from jaxcomp.train._errors import PeerLost
from jaxcomp.train._errors import SetupError
from jaxcomp.train._errors import StorageError
from jaxcomp.train._errors import WorkdirInUse
from jaxcomp.train._errors import setup_phase

log = logging.getLogger(__name__)

#: mode name -> (module of jaxcomp.train, builder); a mode module is imported when used, and
#: an error importing it surfaces as itself
BUILDERS = {
    "dense": ("_dense", "build_dense"),
    "pipeline": ("_pipeline_mode", "build_pipeline"),
    "data_parallel": ("_dp_mode", "build_data_parallel"),
    "ab": ("_ab_mode", "build_ab"),
}


class RunState(NamedTuple):
    """Everything saved in a checkpoint's array item."""

    mode_state: Any  # params, optimizer, link / transform states of the mode
    rng: Any  # uint32 key data of the run's base PRNG key


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
      SetupError: (a ``ValueError``) one line naming the problem (unknown key, model, dataset,
        codec or optimizer, a mesh the devices cannot form, ...).
    """
    with setup_phase():
        # --- Config ----------------------------------------------------------------------
        config = _config.with_defaults(config)
        module, builder = BUILDERS[config.mode]
        build = getattr(importlib.import_module(f"jaxcomp.train.{module}"), builder)
        # --- Mesh ------------------------------------------------------------------------
        try:
            mesh = comm.make_mesh([tuple(a) for a in config.mesh], devices=devices)
        except ValueError as e:
            hint = ""
            if devices is None and jax.default_backend() != "cpu":
                hint = " Set JAX_PLATFORMS=cpu to run on fake CPU devices instead."
            raise SetupError(f"config.mesh: {e}{hint}") from e
        # --- Data ------------------------------------------------------------------------
        train_src = data.get_dataset(config.data_name, "train", **dict(config.data))
        eval_kwargs = {**dict(config.data), **dict(config.eval_data)}
        eval_src = data.get_dataset(config.data_name, "test", **eval_kwargs)
        train_loader_with = functools.partial(
            data.Loader, train_src, config.batch_size, seed=config.seed, augment=config.augment
        )
        train_loader = train_loader_with()  # checks the batch size before the model is built
        eval_loader = data.Loader(
            eval_src, config.eval_batch_size, seed=config.seed, shuffle=False, drop_last=False
        )
        # --- Model & mode ----------------------------------------------------------------
        model = _precision.policy(config, models.get_model(config.model_name, **dict(config.model)))
        check_outputs(model, config, train_src, eval_src)
        mode = build(config, model, mesh, len(train_src))
        if mode.sample_shards > 1:
            train_loader = train_loader_with(shards=mode.sample_shards)
    return Setup(config, mesh, model, train_loader, eval_loader, mode)


def check_outputs(model: models.StagedModel, config, *sources) -> None:
    """A model with more or fewer outputs than the dataset has classes (its vocabulary, for a
    language model) would train silently wrong (labels past the head one-hot to zeros).

    Raises:
      ValueError: naming both counts and the config key to set.
    """
    lm = model.task == "language_model"
    key, what = ("vocab_size", "tokens") if lm else ("num_classes", "classes")
    for src in sources:
        classes = getattr(src, "num_classes", None)
        if classes is not None and classes != model.num_outputs:
            raise ValueError(
                f"model {config.model_name!r} has {model.num_outputs} outputs but dataset "
                f"{config.data_name!r} has {classes} {what}: set config.model.{key}={classes}."
            )


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
    for k, a in _fetch.fetch(tree).items():  # whole values, in every process
        out[k] = float(a) if a.ndim == 0 else a.tolist()
    return out


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean per-token cross-entropy in nats (capped at ``exp(50)``; NaN stays
    NaN)."""
    return math.exp(min(loss, 50.0)) if loss == loss else math.nan


def evaluate(s: Setup, state: RunState, compressed: bool, beat=None) -> dict[str, float]:
    """Mean loss and accuracy over the whole test split (``beat()`` after each batch: the
    watchdog of a multi-process run sees progress)."""
    totals: dict[str, float] = {"loss_sum": 0.0, "correct_sum": 0.0, "count": 0.0}
    for batch in s.eval_loader.epoch(0):
        sums = s.mode.eval_step(state.mode_state, place(batch, s.mode.batch_sharding), compressed)
        for k, v in _scalars(sums).items():
            totals[k] += v
        if beat is not None:
            beat()
    n = max(totals["count"], 1.0)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct_sum"] / n}


#: the loop's host-side counters and accumulators, saved in every checkpoint's ``meta``
FRESH_META = {
    "step": 0,
    "epoch": 0,
    "index": 0,
    "nonfinite_total": 0,
    "nonfinite_streak": 0,
    "window": [],  # per-step metrics since the last train record
    "wire_sum": 0.0,  # bytes of the finite steps so far (the summary's mean)
    "wire_count": 0,
    "wall_time_s": 0.0,  # wall time of the calls before this one, up to their last checkpoint
}


#: seconds without progress after which a process of a multi-process run gives up on the
#: others (the CLI's ``--peer_timeout``)
PEER_TIMEOUT_S = 90.0


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    devices=None,
    stop_after: int | None = None,
    peer_timeout_s: float = PEER_TIMEOUT_S,
) -> dict[str, Any]:
    """Trains and evaluates ``config`` in ``workdir``, resuming from its latest checkpoint.

    Writes ``metrics.jsonl``, ``train.csv``, ``eval.csv``, ``metrics.png``, ``summary.json``
    and ``summary.txt`` into ``workdir`` (on process 0), and prints progress and the summary.
    A resumed run continues bit-identically (metrics, accumulators and summary included); a
    finished workdir is left as it is. On SIGTERM or SIGINT the run finishes its step, saves a
    checkpoint and raises :class:`Interrupted`; a second signal raises ``Aborted`` at once. One
    received while the programs compile raises :class:`Interrupted` at once, in a single
    process (nothing to save yet; the compiles under way are dropped).

    Args:
      config: an experiment config (see ``configs/``).
      workdir: the run directory; created if missing.
      devices: devices for the mesh (default: all).
      stop_after: stop (after checkpointing) once this many steps have run in this call; used
        to test resumption.
      peer_timeout_s: with several processes, the bound: a process whose training loop makes
        no progress for this long (another process stopped, hung or cut off) exits with
        ``PeerLost.exit_code`` and a line naming the process (:mod:`._watchdog`); a process
        that comes back sooner does not stop the run. It must exceed the longest step,
        evaluation or checkpoint wait.

    Returns:
      The summary: final metrics, bytes per step, wall time (the finished run's summary if
      the workdir was finished already).

    Raises:
      SetupError: a bad config, mesh or workdir (one line), before any step.
      NonFiniteError: after ``max_nonfinite_in_a_row`` skipped steps (the last good state saved).
      Interrupted: on the first SIGTERM/SIGINT, with the step's checkpoint saved.
      WorkdirInUse: (a ``SetupError``) another live run holds the workdir; its line names it.
      StorageError: a checkpoint or the workdir could not be written, or the workdir vanished
        (one line; the last good checkpoint kept).
      PeerLost: another process of the run is gone (a failed collective; one line naming it).
    """
    t_start = time.perf_counter()
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    # --- Config & workdir (nothing compiled yet) -------------------------------------------
    with setup_phase():
        config = _config.with_defaults(config)
        fp = _config.fingerprint(config)
    with (
        _workdir.prepared(workdir),
        _signals.StopOnSignal() as stop,
        _holding(workdir, say) as lock,
    ):
        with setup_phase():
            latest = None
            if _workdir.has_checkpoints(workdir):
                probe = _checkpoint.Checkpointer(workdir, config.keep_checkpoints)
                latest = probe.latest_meta()
                probe.close()
            _workdir.check_experiment(workdir, fp, latest)
            _workdir.check_topology(workdir, latest, config.mesh, _here(devices))
            done = _workdir.finished_summary(workdir, config.total_steps, latest)
        if done is not None:
            say(_workdir.finished_message(workdir, config, done["steps"]))
            return done
        at = latest[0] if latest else 0
        if stop.should_stop():  # a signal during startup: before compiling anything
            raise Interrupted(
                stop.signum, at, f"interrupted by {stop.name} before step {at + 1}; nothing "
                "new to save."
            )  # fmt: skip
        say(
            f"jaxcomp: {config.mode} | model {config.model_name}, data {config.data_name}, "
            f"batch {config.batch_size}, {config.total_steps} steps, mesh {dict(config.mesh)}"
        )
        try:  # a signal while compiling stops the run at once (nothing to save yet)
            with stop.at_once(), _progress.compiles_announced(say):
                s = setup(config, devices=devices)
        except _signals.StopNow:
            raise Interrupted(
                stop.signum, at, f"interrupted by {stop.name} while compiling, before step "
                f"{at + 1}; nothing new to save."
            ) from None  # fmt: skip
        _describe(s, say)
        dog = None
        if jax.process_count() > 1:
            team = _watchdog.peers()
            dog = _watchdog.Watchdog(peer_timeout_s, PeerLost.exit_code, team, on_exit=lock.release)
        lost = (lambda: dog.lost(wait_s=3 * dog.interval_s)) if dog else None
        # on an error, pending saves finish before it propagates (not when a peer is lost)
        with _checkpoint.Checkpointer(workdir, config.keep_checkpoints) as ckpt:
            lock.own_saves = ckpt.in_flight  # removed with a lost workdir they recreated
            with _processes.peer_failures_as_lost(lost), _workdir.writing(workdir):
                run = (s, ckpt, lock, dog, fp, workdir, stop_after, stop, t_start, say)
                return _train(*run)


def _here(devices) -> dict[str, Any]:
    """This run's processes, devices per process and platform (``devices``: the mesh's, when
    given), before any mesh is built."""
    devices = list(jax.devices() if devices is None else devices)
    processes = jax.process_count()
    return {
        "processes": processes,
        "devices_per_process": len(devices) // processes,
        "platform": devices[0].platform,
    }


@contextlib.contextmanager
def _holding(workdir: str, say):
    """Holds the workdir's lock for the run (process 0 takes it, every process learns the
    outcome); refuses a workdir that a live run holds.

    Raises:
      WorkdirInUse: naming the other run (on every process).
    """
    lock = _lock.RunLock(workdir, hold=jax.process_index() == 0)
    try:
        lock.acquire()
        refused = ""
    except WorkdirInUse as e:
        refused = str(e)
    refused = _processes.text_of_process_0(refused)
    if refused:
        lock.release()
        raise WorkdirInUse(refused)
    if lock.taken_over:
        say(f"jaxcomp: took over the lock of a run that is gone: {lock.taken_over}.")
    try:
        yield lock
    finally:
        lock.release()
        # a deleted workdir stays deleted; runs after the Checkpointer exited (its saves ended)
        lock.remove_recreated()


#: what a process tells the others when it cannot go on (agreed after every step); a failed
#: checkpoint is FAULT_CHECKPOINT + its cause's code (``Checkpointer.cause_code``)
FAULT_WORKDIR, FAULT_SAVE, FAULT_CHECKPOINT = 1, 2, 10
_FAULTS = {
    FAULT_WORKDIR: "lost its workdir (deleted, replaced or taken over)",
    FAULT_SAVE: "could not write its workdir",
}


def _describe(s: Setup, say) -> None:
    """The run's description once set up (the config's line is printed before, then each
    program as its compile starts)."""
    mode = s.mode
    say(f"  {mode.description}")
    say(
        f"  model {s.model.name} ({s.model.num_stages} stage(s)): "
        f"{s.train_loader.num_examples} train / {s.eval_loader.num_examples} test examples"
    )
    if s.train_loader.shards > 1:
        r = s.train_loader.shards
        say(
            f"  per-sample buffers on {r} data replicas: sample i is always trained on replica "
            f"i mod {r} (fixed shards, each shuffled per epoch)"
        )
    wire0 = (
        "reported each step"
        if math.isnan(mode.wire_bytes)
        else _metrics.format_bytes(mode.wire_bytes)
    )
    say(f"  wire bytes/step {wire0} (dense {_metrics.format_bytes(mode.dense_bytes)})")


def _health(lock, ckpt, held, stop, step: int) -> None:
    """Stops every process at once when one lost its workdir, could not write to it
    (``held``: metrics) or a checkpoint failed to be written; agrees on signals on the way
    (one collective per step).

    Raises:
      StorageError: the local problem, or which process stopped the run.
    """
    problem = lock.check()
    if problem is None:
        ckpt.workdir_intact()
    code = FAULT_WORKDIR if problem else 0
    if problem:
        problem += f" (found after step {step}); nothing more is written (a checkpoint would " \
            "recreate it), the run stops"  # fmt: skip
    elif held.problem:
        problem, code = held.problem, FAULT_SAVE
    else:
        problem = ckpt.failed_save()
        code = FAULT_CHECKPOINT + ckpt.cause_code() if problem else 0
    codes = stop.agree(code)
    if not codes.any():
        return
    if (codes >= FAULT_CHECKPOINT).any():  # every process leaves that save at once (agreed)
        ckpt.stuck = ckpt.processes > 1
    if not problem:
        k = int(codes.nonzero()[0][0])
        if codes[k] >= FAULT_CHECKPOINT:
            problem = ckpt.failed_elsewhere(k, int(codes[k]) - FAULT_CHECKPOINT)
        else:
            problem = (
                f"process {k} {_FAULTS[int(codes[k])]} after step {step} (see its output); "
                "this process stops with it"
            )
    raise StorageError(problem)


def _train(s, ckpt, lock, dog, fp, workdir, stop_after, stop, t_start, say) -> dict[str, Any]:
    """Restores, runs the loop (watched by ``dog`` with several processes), evaluates and
    writes the summary."""
    try:
        return _loop(s, ckpt, lock, dog, fp, workdir, stop_after, stop, t_start, say)
    finally:
        if dog is not None:
            dog.stop()


def _loop(s, ckpt, lock, dog, fp, workdir, stop_after, stop, t_start, say) -> dict[str, Any]:
    lead = jax.process_index() == 0
    mode, cfg = s.mode, s.config
    writer = _metrics.MetricWriter(
        workdir, lead, cfg.writers, json.loads(cfg.to_json_best_effort())
    )
    held = _workdir.HeldWriteError(workdir)  # a failed metrics write stops every process
    # modes place their own state; no ambient mesh (shard_map bodies may seed PRNGs)
    state = RunState(
        mode.init(jax.random.key(cfg.seed)),
        _replicated(np.asarray(jax.random.key_data(jax.random.key(cfg.seed))), s.mesh),
    )
    meta = copy.deepcopy(FRESH_META)
    topology = _workdir.topology(s.mesh)
    with setup_phase():
        restored = ckpt.restore_latest(state)
        if restored is not None:
            _, state, saved_meta = restored
            meta.update(saved_meta)  # its step <= total_steps: checked from its meta before
            _workdir.check_partition(
                workdir, meta["step"], saved_meta.get("data_split"), s.train_loader.partition
            )
            say(f"  resumed from step {meta['step']}")
            change = _workdir.topology_change(saved_meta.get("topology"), topology)
            if change:
                say(f"  {change}")
        writer.truncate_after(int(meta["step"]))  # a fresh start clears an old run's rows
    if lead:
        _workdir.write_experiment(workdir, fp)
    step = int(meta["step"])
    data_state = data.LoaderState(int(meta["epoch"]), int(meta["index"]))
    run = {k: meta[k] for k in ("nonfinite_total", "nonfinite_streak", "window")}
    run.update(wire_sum=float(meta["wire_sum"]), wire_count=int(meta["wire_count"]))
    wall0 = float(meta["wall_time_s"])
    base_key = jax.random.wrap_key_data(np.asarray(state.rng.addressable_data(0)))
    saved = [step if restored is not None else -1]

    def save(at_step):
        if saved[0] == at_step:
            return
        m = {"step": at_step, "epoch": data_state.epoch, "index": data_state.index, **run}
        m.update(fingerprint=fp, topology=topology, data_split=s.train_loader.partition)
        m.update(wall_time_s=wall0 + time.perf_counter() - t_start)
        if ckpt.save(at_step, state, m):
            saved[0] = at_step

    def interrupt(message):
        ckpt.close()
        writer.close()
        raise Interrupted(stop.signum, step, f"interrupted by {stop.name} {message}")

    if stop.should_stop():
        interrupt(f"before step {step + 1}; nothing new to save.")
    _compile_ahead(s, state, ckpt)
    probe = _link_probe.for_run(
        cfg.link_probe_every, cfg.link_probe_bytes, list(s.mesh.devices.flat), say
    )
    if dog is not None:  # from here on, every step is bounded
        dog.start()
    progress = _progress.Progress(cfg.total_steps, step, enabled=lead)
    logged, step_seconds = step, 0.0  # the writers' step time since the last train record
    cold = _cold_sends.ColdSendWatch()
    # --- Loop ----------------------------------------------------------------------------
    while step < cfg.total_steps:
        t_step = time.perf_counter()
        batch, data_state = s.train_loader.next(data_state)
        key = np.asarray(jax.random.key_data(jax.random.fold_in(base_key, step)))
        state_ms, metrics = mode.train_step(
            state.mode_state, place(batch, mode.batch_sharding), _replicated(key, s.mesh), step
        )
        state = state._replace(mode_state=state_ms)
        step += 1
        m = _scalars(metrics)  # waits for the step
        cold_line = cold.see(batch.get("ids"), m, step)
        if cold_line:
            progress.message(cold_line)
        now = time.perf_counter()
        step_seconds += now - t_step
        if dog is not None:
            dog.beat(step)
        _health(lock, ckpt, held, stop, step)  # before any write: never into a recreated workdir
        with held.catching():
            writer.write_time(step, now - t_step, wall0 + now - t_start)
        if m.get("finite", 1.0) < 1.0:
            run["nonfinite_total"] += 1
            run["nonfinite_streak"] += 1
            progress.message(f"step {step}: non-finite loss, gradient or update; step skipped.")
            if run["nonfinite_streak"] >= cfg.max_nonfinite_in_a_row:
                save(step)
                ckpt.close()
                writer.close()
                raise NonFiniteError(
                    f"{run['nonfinite_streak']} training steps in a row had a non-finite loss, "
                    f"gradient or update (last at step {step}); stopping with the last finite "
                    "state saved. Lower the learning rate or check the data."
                )
        else:
            run["nonfinite_streak"] = 0
            run["window"].append(m)
            run["wire_sum"] += m.get("wire_bytes", mode.wire_bytes)
            run["wire_count"] += 1
        if step % cfg.log_every == 0 or step == cfg.total_steps:
            # m: this version's keys; a step without wire_bytes sent the mode's (a pipeline's
            # warm-up steps report their own)
            avg, lost = _metrics.window_mean(run["window"], m, {"wire_bytes": mode.wire_bytes})
            if lost:  # steps of a checkpoint written by an older version
                progress.message(
                    f"step {step}: the checkpoint's per-step metrics {lost} are no longer "
                    "written (their metric was removed); left out of this record."
                )
            avg.setdefault("wire_bytes", mode.wire_bytes)  # a mode may report it per step
            avg.update(nonfinite_steps=run["nonfinite_total"], epoch=data_state.epoch)
            seconds = step_seconds / (step - logged)
            with held.catching():
                writer.write(
                    step, "train", {k: v for k, v in avg.items() if k != "finite"}, seconds
                )
            logged, step_seconds = step, 0.0
            progress.update(step, avg, final=step == cfg.total_steps)
            run["window"] = []
        if probe is not None and step % cfg.link_probe_every == 0:
            links, line = _link_probe.record(probe, step, dog.team if dog else None)
            if dog is not None:
                dog.beat(step)
            with held.catching():
                writer.write(step, "links", links)
            if line:
                progress.message(line)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.total_steps:
            with held.catching():
                _log_eval(s, state, step, writer, progress, dog=dog)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save(step)
        if stop.signum is not None and step < cfg.total_steps:  # agreed by _health
            save(step)
            interrupt(
                f"after step {step} of {cfg.total_steps}; checkpoint saved in "
                f"{ckpt.directory}. Run the same command again to resume."
            )
        if stop_after is not None and step - int(meta["step"]) >= stop_after:
            save(step)
            ckpt.close()
            writer.close()
            return {"stopped_at": step}
    # --- Evaluation & summary ----------------------------------------------------------------
    # restored at the last step (a run stopped before writing its summary): the final eval
    # may be on record already; every process evaluates, only a missing record is written
    write = not (restored is not None and saved[0] == step and writer.find(step, "eval"))
    final = {}  # a failed write of its record stops the run at the _health below
    with held.catching():
        final = _log_eval(s, state, step, writer, progress, write=write, dog=dog)
    _health(lock, ckpt, held, stop, step)
    save(step)
    _close_final(ckpt, lock, step)
    wire = run["wire_sum"] / run["wire_count"] if run["wire_count"] else mode.wire_bytes
    wall = wall0 + time.perf_counter() - t_start
    summary = _workdir.summarize(s, final, step, run["nonfinite_total"], wall, wire)
    if lead:
        _workdir.write_summary(workdir, summary, f"summary: {cfg.mode} / {s.model.name}")
    writer.write_summary(step, summary)
    writer.close()
    return summary


def _close_final(ckpt: _checkpoint.Checkpointer, lock: _lock.RunLock, step: int) -> None:
    """Closes the checkpoints once the final one is saved, and checks that the workdir is
    still the run's: deleted while that save was written, it was recreated by the save (or
    made it fail), and nothing more (the summary) may be written.

    Raises:
      StorageError: the workdir's line (rather than the failed save's, its consequence), or
        the save's own failure.
    """
    try:
        ckpt.close()
    except StorageError as e:
        problem = lock.check()
        if problem is None:
            raise
        raise StorageError(_lost_at_the_end(problem, step)) from e
    problem = lock.check()
    if problem is not None:
        raise StorageError(_lost_at_the_end(problem, step))


def _lost_at_the_end(problem: str, step: int) -> str:
    return (
        f"{problem} (found while saving the final checkpoint, step {step}); nothing more is "
        "written, the run stops"
    )


def _compile_ahead(s: Setup, state: RunState, ckpt: _checkpoint.Checkpointer) -> None:
    """Compiles what evaluations and checkpoints will run, before the first training step.

    Compiled at their first use, the evaluation step and the checkpoint checksum stalled the
    run at its first evaluation (issue 13: 1.3-2.2 s on 2 cores). One evaluation batch goes
    through every evaluation the run makes (with compression on and off) and the state through
    the checksum pass; results are discarded, nothing is saved or written.
    """
    ckpt.prepare(state)
    batch = place(next(iter(s.eval_loader.epoch(0))), s.mode.batch_sharding)
    for compressed in sorted({False, s.mode.has_compressed_eval}):
        jax.block_until_ready(s.mode.eval_step(state.mode_state, batch, compressed))


def _log_eval(s: Setup, state, step, writer, progress, write: bool = True, dog=None) -> dict:
    out = {}
    beat = None if dog is None else (lambda: dog.beat(step))
    off = evaluate(s, state, compressed=False, beat=beat)
    if s.mode.has_compressed_eval:
        on = evaluate(s, state, compressed=True, beat=beat)
        out.update(loss=on["loss"], accuracy=on["accuracy"])
        out.update(loss_uncompressed=off["loss"], accuracy_uncompressed=off["accuracy"])
        progress.message(
            f"  eval @ {step}: accuracy {on['accuracy']:.4f} (compression on), "
            f"{off['accuracy']:.4f} (off); loss {on['loss']:.4f} / {off['loss']:.4f}"
        )
    else:
        out.update(loss=off["loss"], accuracy=off["accuracy"])
        progress.message(f"  eval @ {step}: accuracy {off['accuracy']:.4f}, loss {off['loss']:.4f}")
    if s.model.task == "language_model":  # loss -> perplexity, loss_uncompressed -> ...
        losses = {k: v for k, v in out.items() if k.startswith("loss")}
        ppl = {k.replace("loss", "perplexity"): perplexity(v) for k, v in losses.items()}
        out.update(ppl)
        progress.message("    perplexity " + " / ".join(f"{v:.3f}" for v in ppl.values()))
    if write:
        writer.write(step, "eval", out)
    return out
