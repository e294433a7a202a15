"""Metric writers beside the run's own files: TensorBoard and Weights & Biases.

One config switch, ``config.writers``, names them (default: none)::

  c.writers = ("tensorboard",)            # or ("tensorboard", "wandb")
  python -m jaxcomp.main ... --set 'writers=("tensorboard",)'

Every record the run writes to ``metrics.jsonl`` goes to each writer as scalars tagged
``<split>/<key>`` at the record's step (``train/loss``, ``train/wire_bytes``,
``train/fast_wire_bytes``, ``train/phase``, Accordion's ``train/layer_mode/<name>``, AB's
``train/rank/<name>`` (a parameter named by its path in the model, ``fc2/Dense_0/kernel``),
``eval/accuracy_uncompressed``, ...), with the mean wall time of a training step in the
window (``train/step_time_s``, not kept in ``metrics.jsonl``, so that a resumed run's files
stay identical to an uninterrupted one's). At the end the summary's numbers go as
``summary/<key>`` and its collectives as bytes per mean step per kind and group size
(``collectives/all-reduce/8``).

TensorBoard events are written by ``tensorboardX`` (no TensorFlow) into
``<workdir>/tensorboard``: ``tensorboard --logdir runs/`` shows every run by its workdir. A run
that resumes from step ``s`` marks the events after ``s`` of the interrupted attempt as purged
(TensorBoard's ``purge_step``), so they show the same steps as ``metrics.jsonl``; a fresh start
removes an earlier run's event files. A run resumed from before a metric was renamed
(``_metrics.RENAMED``) writes that metric's earlier steps again under its current tag; the old
tag keeps its steps in the earlier event files. W&B logs to ``<workdir>/wandb`` through
``wandb.init`` (its settings from the environment: ``WANDB_MODE=offline``,
``WANDB_PROJECT``; default project ``jaxcomp``), resuming the same W&B run id (kept in
``<workdir>/wandb_run_id``); W&B drops steps below the ones it has, so the interrupted
attempt's last records stay there (and a renamed metric's earlier steps are not written again).
"""

from __future__ import annotations

import collections
import glob
import json
import math
import os
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp.train import _extras

#: writer name -> (the module it needs, the jaxcomp extra that installs it)
WRITERS = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}
TENSORBOARD_DIR = "tensorboard"


def check(names: Any) -> tuple[str, ...]:
    """Validates ``config.writers``: a tuple of names from :data:`WRITERS`, each installed.

    Args:
      names: ``None``, one name, or a sequence of names.

    Returns:
      The names as a tuple, duplicates dropped.

    Raises:
      ValueError: for an unknown name, or (one line naming the extra) a writer whose package
        is not installed.
    """
    if names is None:
        return ()
    names = (names,) if isinstance(names, str) else tuple(names)
    out = []
    for name in names:
        if name not in WRITERS:
            raise ValueError(
                f"config.writers: unknown writer {name!r}; allowed are {sorted(WRITERS)}."
            )
        module, extra = WRITERS[name]
        _extras.require(module, extra, f"config.writers={name!r}")
        if name not in out:
            out.append(name)
    return tuple(out)


def _numbers(scalars: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in scalars.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # names, lists: not a scalar series
        out[k] = float(v)
    return out


def summary_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a run's summary as writer tags: ``summary/<key>`` and, from its
    ``collectives`` records, ``collectives/<kind>/<group size>`` in bytes per mean step."""
    out = {f"summary/{k}": v for k, v in _numbers(summary).items() if math.isfinite(v)}
    per_kind: dict[str, float] = collections.defaultdict(float)
    for r in summary.get("collectives") or ():
        per_kind[f"collectives/{r['kind']}/{r['group_size']}"] += (
            r["bytes_per_execution"] * r["executions"]
        )
    out.update(per_kind)
    return out


class TensorBoardWriter:
    """Scalars into TensorBoard event files under ``<workdir>/tensorboard``.

    Args:
      workdir: the run directory.
      start_step: the step the run starts from (``0``: fresh; old event files removed).
      config: the experiment config as JSON-able data, written once as text.
    """

    #: events at steps before the last one written are kept (a renamed metric's earlier steps)
    takes_earlier_steps = True

    def __init__(self, workdir: str, start_step: int, config: Mapping[str, Any] | None = None):
        from tensorboardX import SummaryWriter

        self.logdir = os.path.join(workdir, TENSORBOARD_DIR)
        if start_step == 0:
            for path in glob.glob(os.path.join(self.logdir, "events.out.tfevents.*")):
                os.remove(path)
        purge = start_step + 1 if start_step > 0 else None
        # an event file's name holds the second it was opened: two opened in one second (a
        # quick resume) would share it and the second would overwrite the first
        n = 0
        while glob.glob(os.path.join(self.logdir, f"events.out.tfevents.*.{start_step}.{n}")):
            n += 1
        self._w = SummaryWriter(
            self.logdir, purge_step=purge, flush_secs=3600, filename_suffix=f".{start_step}.{n}"
        )
        if config is not None and start_step == 0:
            text = "```\n" + json.dumps(dict(config), indent=1, default=str) + "\n```"
            self._w.add_text("config", text, 0)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._w.add_scalar(tag, value, int(step))
        self._w.flush()  # records are rare (every log_every steps): on disk at once

    def close(self) -> None:
        self._w.close()


class WandbWriter:
    """Scalars into a Weights & Biases run (``wandb.init(dir=workdir, resume="allow")``).

    Args:
      workdir: the run directory (the W&B files and the run id live there).
      start_step: unused (W&B keeps its own position); for the same signature.
      config: the experiment config, given to ``wandb.init``.
    """

    #: W&B drops a step below the run's last one
    takes_earlier_steps = False

    def __init__(self, workdir: str, start_step: int, config: Mapping[str, Any] | None = None):
        import wandb

        del start_step
        id_path = os.path.join(workdir, "wandb_run_id")
        run_id = None
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jaxcomp"),
            name=os.path.basename(os.path.abspath(workdir)),
            dir=workdir,
            id=run_id,
            resume="allow",
            config=dict(config or {}),
        )
        with open(id_path, "w") as f:
            f.write(self._run.id)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def close(self) -> None:
        self._run.finish()


_CLASSES = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter}


def open_writers(
    names: Sequence[str], workdir: str, start_step: int, config: Mapping[str, Any] | None = None
) -> list:
    """The writers named by ``config.writers`` (already :func:`check`-ed), opened at
    ``start_step``."""
    return [_CLASSES[name](workdir, start_step, config) for name in names]


def tagged(split: str, scalars: Mapping[str, Any]) -> dict[str, float]:
    """A record's numbers as ``<split>/<key>`` tags."""
    return {f"{split}/{k}": v for k, v in _numbers(scalars).items()}
