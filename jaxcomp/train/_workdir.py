"""The run directory: what it may hold when a run starts, and the summary a run ends with.

A workdir belongs to one experiment: ``experiment.json`` records its fingerprint (the config
without run-length keys) and every checkpoint's metadata repeats it, so a different config is
refused by name even when ``experiment.json`` was deleted. A run whose last checkpoint is its
final step and whose ``summary.json`` is written is finished: running it again changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from typing import Any

from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _errors
from jaxcomp.train import _metrics

EXPERIMENT = "experiment.json"
SUMMARY = "summary.json"


@contextlib.contextmanager
def prepared(workdir: str):
    """Creates ``workdir`` if missing (:func:`prepare`) for the enclosed run; if the run ends
    in an error and this call created the workdir, which is still empty (a config refused
    before the first step), removes it. A workdir that existed before, or holds anything,
    stays.
    """
    created = not os.path.exists(workdir)
    prepare(workdir)
    try:
        yield
    except BaseException:
        if created:
            with contextlib.suppress(OSError):  # not empty, or another process removed it
                os.rmdir(workdir)
        raise


def prepare(workdir: str) -> None:
    """Creates ``workdir`` if missing.

    Raises:
      SetupError: if it is a file, cannot be created or is not writable.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise _errors.SetupError(
            f"workdir {workdir!r} is a file, not a directory; give --workdir a directory."
        )
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise _errors.SetupError(f"cannot create workdir {workdir!r}: {e.strerror}.") from e
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise _errors.SetupError(f"workdir {workdir!r} is not writable.")


#: errors of a write that fail for the disk, not the program (``open(..., "a")`` reports a full
#: disk at ``write``/``close``, without a file name)
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def write_failure(workdir: str, error: OSError) -> str | None:
    """The line for an ``OSError`` writing ``workdir`` (``None`` when it is about another
    path: the data, the compile cache)."""
    root = os.path.abspath(workdir)
    path = os.path.abspath(str(error.filename)) if error.filename else ""
    if not (path == root or path.startswith(root + os.sep)):
        if path or error.errno not in _DISK_ERRNOS:
            return None
        path = root
    try:
        free = f" ({_metrics.format_bytes(shutil.disk_usage(root).free)} free)"
    except OSError:
        free = ""
    return (
        f"cannot write {path}: {error.strerror or error}{free}; the run stops, its last good "
        "checkpoint stays. Fix that and run the same command to resume."
    )


@contextlib.contextmanager
def writing(workdir: str):
    """Turns an ``OSError`` writing ``workdir`` (metrics, summary, records on a full,
    read-only or vanished disk) into one line: :class:`~jaxcomp.train.StorageError`.

    Errors on other paths (the data, the compile cache) pass as they are.
    """
    try:
        yield
    except OSError as e:
        problem = write_failure(workdir, e)
        if problem is None:
            raise
        raise _errors.StorageError(problem) from e


class HeldWriteError:
    """Holds an ``OSError`` writing the workdir (process 0's metrics) until every process
    agrees to stop after the next step, so that no process is left in a collective.

    Example:
      >>> held = HeldWriteError(workdir)  # doctest: +SKIP
      >>> with held.catching():  # doctest: +SKIP
      ...     writer.write(step, "train", scalars)
      >>> held.problem  # None, or the line for the error  # doctest: +SKIP
    """

    def __init__(self, workdir: str):
        self.workdir, self.problem = workdir, None

    @contextlib.contextmanager
    def catching(self):
        try:
            yield
        except OSError as e:
            problem = write_failure(self.workdir, e)
            if problem is None:
                raise
            self.problem = self.problem or problem


def has_checkpoints(workdir: str) -> bool:
    return os.path.isdir(os.path.join(workdir, "checkpoints"))


def check_experiment(workdir: str, fp: dict[str, Any], latest: tuple[int, dict] | None) -> None:
    """Refuses a workdir that holds another experiment.

    Args:
      workdir: the run directory.
      fp: this config's fingerprint (:func:`jaxcomp.train._config.fingerprint`).
      latest: ``(step, meta)`` of the workdir's newest readable checkpoint, if any.

    Raises:
      SetupError: naming the config keys that differ (from ``experiment.json`` or, when that
        record was deleted, from the checkpoint's own copy of the fingerprint).
    """
    path = os.path.join(workdir, EXPERIMENT)
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:
            raise _errors.SetupError(
                f"{path} is unreadable ({e}); it records which experiment the workdir holds. "
                "Delete it only if the checkpoints belong to this config."
            ) from e
        if old != fp:
            keys = _config.diff_keys(old, fp)
            _refuse_horizon(workdir, keys, old, fp)
            raise _errors.SetupError(
                f"workdir {workdir!r} holds a checkpoint of another experiment "
                f"(config differs in {_listed(keys)}); use a new --workdir."
            )
    if latest is None:
        return
    step, meta = latest
    saved = meta.get("fingerprint")
    missing = "" if os.path.exists(path) else f" (its {EXPERIMENT} is missing)"
    if isinstance(saved, dict) and saved != fp:
        keys = _config.diff_keys(saved, fp)
        _refuse_horizon(workdir, keys, saved, fp)
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of another experiment"
            f"{missing}: the config differs in {_listed(keys)}; use a new --workdir."
        )
    if isinstance(saved, str) and saved != _config.fingerprint_hash(fp):
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of another experiment"
            f"{missing}: its config fingerprint differs from this config's; use a new --workdir."
        )


def _listed(keys: list[str], most: int = 6) -> str:
    """The differing keys for a line, top-level keys first (a changed ``mode`` is named
    before its sub-keys), at most ``most`` of them and how many more."""
    keys = sorted(keys, key=lambda k: k.count("."))
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return f"{keys[:most]}{more}"


def _refuse_horizon(workdir: str, keys: list[str], old: dict, fp: dict) -> None:
    """The line for a resume that would move a cosine schedule's horizon (and nothing else).

    Raises:
      SetupError: when ``keys`` (the differing keys) is ``["schedule_steps"]``.
    """
    if keys != ["schedule_steps"]:
        return
    was, now = old.get("schedule_steps"), fp.get("schedule_steps")
    if was is None:  # recorded before the horizon was: its total_steps is unknown
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a {fp['schedule']} run whose schedule horizon was not "
            f"recorded; this config's ends at step {now}: set config.schedule_steps to the "
            "total_steps it was started with, or use a new --workdir."
        )
    what = "a schedule ending" if now is None else f"its {fp['schedule']} schedule ends"
    raise _errors.SetupError(
        f"workdir {workdir!r} holds a run whose {old['schedule']} schedule ends at step {was} "
        f"(config.schedule_steps, by default total_steps); with this config {what} at step "
        f"{now}, which changes every step's learning rate. To run on with the saved schedule "
        f"(past step {was} its learning rate stays at its end value), add --set "
        f"schedule_steps={was}; for another schedule use a new --workdir."
    )


def finished_message(workdir: str, config: Any, steps: int) -> str:
    """What a rerun of a finished workdir prints: how to continue it, if it can be."""
    head = (
        f"jaxcomp: the run in {workdir} is finished ({steps} of {config.total_steps} steps); "
        "nothing to do."
    )
    if config.schedule in _config.HORIZON_SCHEDULES:
        horizon = _config.schedule_horizon(config)
        return (
            f"{head} Its {config.schedule} schedule ends at step {horizon}: a longer run with "
            f"another horizon is a new --workdir (raising total_steps alone is refused); its "
            "summary is summary.txt."
        )
    return f"{head} Raise total_steps to continue it; its summary is summary.txt."


def topology(mesh: Any) -> dict[str, Any]:
    """Where a run computes: processes, the mesh's devices per process, platform and the
    mesh's axis sizes (saved with every checkpoint; not part of the experiment's identity)."""
    import jax

    return {
        "processes": jax.process_count(),
        "devices_per_process": mesh.devices.size // jax.process_count(),
        "platform": mesh.devices.flat[0].platform,
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
    }


_WHERE = ("processes", "devices_per_process", "platform")


def _where(t: dict) -> str:
    return (
        f"{t.get('processes')} process(es) x {t.get('devices_per_process')} "
        f"{t.get('platform')} device(s)"
    )


def topology_change(saved: dict | None, now: dict) -> str | None:
    """The line a resume on other processes, devices or platform prints, or ``None``.

    Supported exactly when the mesh is the same (:func:`check_topology` refuses another one):
    the state is restored bit for bit (its checksums verified) and laid out on this run's
    devices by its mesh, whose axes and sizes the experiment fixes; the steps after it compute
    the same values as an uninterrupted run up to float rounding, since collectives spread
    over other processes reduce in another order (2 x 4 devices <-> 1 x 8: the final loss
    within 1e-5 relative; tests/train/test_two_processes.py, 2 x 2 <-> 1 x 4).
    """
    if not isinstance(saved, dict) or all(saved.get(k) == now.get(k) for k in _WHERE):
        return None
    return (
        f"the checkpoint was saved by {_where(saved)}, this run has {_where(now)}: its state is "
        "restored exactly; later steps match an uninterrupted run up to float rounding "
        "(collectives reduce in another order)."
    )


def mesh_sizes(axes: Any, devices: int) -> dict[str, int] | None:
    """The axis sizes ``config.mesh`` (``[(name, size), ...]``, one size may be ``-1``) has on
    ``devices`` devices, or ``None`` if they cannot form it (or it is malformed: the mesh's
    own check names that)."""
    try:
        names, sizes = [str(a[0]) for a in axes], [int(a[1]) for a in axes]
    except (TypeError, ValueError, IndexError):
        return None
    known = math.prod(n for n in sizes if n != -1)
    if -1 in sizes:
        if sizes.count(-1) > 1 or known <= 0 or devices % known:
            return None
        sizes[sizes.index(-1)] = devices // known
    if min(sizes, default=1) < 1 or math.prod(sizes) > devices:
        return None
    return dict(zip(names, sizes))


def check_topology(
    workdir: str, latest: tuple[int, dict] | None, axes: Any, now: dict[str, Any]
) -> None:
    """Refuses, before anything compiles, to resume a checkpoint on devices that give
    ``config.mesh`` other axis sizes than those it was computed on.

    The mesh is the experiment's (its ``config.mesh`` is in the fingerprint), but a ``-1``
    size fills with the devices at hand, and a mesh needs its devices: on another device count
    the workers (their batches, their compression) would change under the restored state.
    Another split of the same devices into processes is supported (:func:`topology_change`).

    Args:
      workdir: the run directory.
      latest: ``(step, meta)`` of the newest checkpoint, if any.
      axes: ``config.mesh``.
      now: this run's processes, devices per process and platform (:func:`topology`'s keys).

    Raises:
      SetupError: naming both meshes and both device layouts.
    """
    saved = latest[1].get("topology") if latest is not None else None
    if not isinstance(saved, dict):
        return
    before = saved.get("mesh")
    if not isinstance(before, dict):  # saved before the mesh was recorded
        count = saved.get("processes", 0) * saved.get("devices_per_process", 0)
        before = mesh_sizes(axes, count) if isinstance(count, int) else None
    after = mesh_sizes(axes, now["processes"] * now["devices_per_process"])
    if before is None or after == before:
        return
    mesh = [tuple(a) for a in axes]
    gives = f"cannot form config.mesh {mesh}" if after is None else f"give config.mesh {mesh} "
    gives += "" if after is None else f"the sizes {after}"
    raise _errors.SetupError(
        f"checkpoint step {latest[0]} in {workdir} was computed on mesh {before} by "
        f"{_where(saved)}; this run's {_where(now)} {gives}: another mesh changes what each "
        f"step computes. Resume on {math.prod(before.values())} devices, or use a new --workdir."
    )


def check_partition(workdir: str, step: int, saved: Any, now: dict[str, int]) -> None:
    """Refuses to resume a checkpoint whose training split was cut otherwise over the data
    replicas (:attr:`jaxcomp.data.Loader.partition`): its per-sample buffers (AQ-SGD caches,
    one set per replica) hold the samples of the old cut, and the order would change.

    A checkpoint written before the cut was recorded shuffled the whole split (one shard); it
    resumes only where this run keeps one too.

    Raises:
      SetupError: naming both cuts.
    """
    if not isinstance(saved, dict):
        saved = {"shards": 1}  # the whole split shuffled over the batch, as before shards
    differs = sorted(k for k in now if k in saved and saved[k] != now[k])
    if not differs:
        return
    was, cut = {k: saved[k] for k in differs}, {k: now[k] for k in differs}
    raise _errors.SetupError(
        f"checkpoint step {step} in {workdir} was trained on the training split cut as {was}; "
        f"this run cuts it as {cut}: the batches would change, and per-sample buffers (kept "
        "per data replica) would meet other samples. Resume with the same split and data "
        "replicas, or use a new --workdir."
    )


def write_experiment(workdir: str, fp: dict[str, Any]) -> None:
    with open(os.path.join(workdir, EXPERIMENT), "w") as f:
        json.dump(fp, f, indent=1, sort_keys=True)


def finished_summary(
    workdir: str, total_steps: int, latest: tuple[int, dict] | None
) -> dict[str, Any] | None:
    """The summary of a finished run (final checkpoint at ``total_steps`` and its summary
    written), else ``None``.

    Raises:
      SetupError: if the checkpoint is past ``total_steps``.
    """
    if latest is None:
        return None
    step = latest[0]
    if step > total_steps:
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a checkpoint at step {step}, past config.total_steps = "
            f"{total_steps}; set total_steps >= {step} to continue it, or use a new --workdir."
        )
    try:
        with open(os.path.join(workdir, SUMMARY)) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if step == total_steps and isinstance(summary, dict) and summary.get("steps") == step:
        return summary
    return None


def summarize(
    setup: Any, final: dict, step: int, nonfinite: int, wall: float, wire: float
) -> dict[str, Any]:
    """The summary of a run: final metrics, bytes per step over the whole run, wall time."""
    mode = setup.mode
    out = {
        "mode": setup.config.mode,
        "model": setup.model.name,
        "stages": setup.model.num_stages,
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
    if "perplexity" in final:
        out["final_perplexity"] = final["perplexity"]
    if "perplexity_uncompressed" in final:
        out["final_perplexity_uncompressed"] = final["perplexity_uncompressed"]
    info = getattr(setup.eval_loader.source, "info", None) or {}
    if "unigram_perplexity" in info:  # a language model's reference on the same split
        out["unigram_perplexity"] = info["unigram_perplexity"]
    if info:
        out["dataset"] = info
    out.update(mode.extra or {})
    return out


def write_summary(workdir: str, summary: dict, title: str) -> None:
    """Prints the summary table and writes ``summary.txt``, ``summary.json`` and the plot."""
    rows = []
    for k, v in summary.items():
        if "bytes" in k and isinstance(v, (int, float)):
            v = _metrics.format_bytes(v)
        elif k == "wall_time_s":
            v = f"{v:.1f}"
        elif k == "compression_ratio":
            v = f"{v:.1f}x"
        elif k == "collectives":  # the per-kind records, in short: bytes per kind/devices
            k, v = "collective_bytes_per_step", _collectives.describe(v)
        elif k == "dataset" and isinstance(v, dict):  # in full in summary.json
            v = f"{v.get('name')} {v.get('corpus_sha256', '')[:12]} (Python {v.get('python')})"
        rows.append((k, v))
    table = _metrics.summary_table(rows, title=title)
    print(table, flush=True)
    with open(os.path.join(workdir, "summary.txt"), "w") as f:
        f.write(table + "\n")
    png = _metrics.plot_metrics(workdir)
    if png:
        print(f"curves: {png}", flush=True)
    tmp = os.path.join(workdir, SUMMARY + ".tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    os.replace(tmp, os.path.join(workdir, SUMMARY))  # last: its presence marks a finished run
