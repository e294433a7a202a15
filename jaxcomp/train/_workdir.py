"""The run directory: what it may hold when a run starts, and the summary a run ends with.

A workdir belongs to one experiment: ``experiment.json`` records its fingerprint (the config
without run-length keys) and every checkpoint's metadata repeats it, so a different config is
refused by name even when ``experiment.json`` was deleted. A run whose last checkpoint is its
final step and whose ``summary.json`` is written is finished: running it again changes nothing.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _errors
from jaxcomp.train import _metrics

EXPERIMENT = "experiment.json"
SUMMARY = "summary.json"


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
            raise _errors.SetupError(
                f"workdir {workdir!r} holds a checkpoint of another experiment "
                f"(config differs in {keys[:6]}); use a new --workdir."
            )
    if latest is None:
        return
    step, meta = latest
    saved = meta.get("fingerprint")
    missing = "" if os.path.exists(path) else f" (its {EXPERIMENT} is missing)"
    if isinstance(saved, dict) and saved != fp:
        keys = _config.diff_keys(saved, fp)
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of another experiment"
            f"{missing}: the config differs in {keys[:6]}; use a new --workdir."
        )
    if isinstance(saved, str) and saved != _config.fingerprint_hash(fp):
        raise _errors.SetupError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of another experiment"
            f"{missing}: its config fingerprint differs from this config's; use a new --workdir."
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
