"""Metrics on disk (JSON lines and CSV, and the writers of ``config.writers``), a PNG of the
curves, and the final summary table."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcomp.train import _writers

#: per-step wall times (:meth:`MetricWriter.write_time`)
TIMING = "timing.jsonl"

#: metric keys renamed since runs were first written, ``(old spelling, its replacement)``,
#: so that a run resumed from a checkpoint written before a rename keeps one spelling
#: (:func:`renamed_keys`): on 2026-12-05 (commit bcc9b9e) a per-layer metric lost the
#: per-stage tuple's index from its parameter's name (``layer_mode/1/fc2/Dense_0/kernel`` ->
#: ``layer_mode/fc2/Dense_0/kernel``, AB's ``rank/...`` too)
RENAMED = ((re.compile(r"(layer_mode|rank)/\d+/(.+)"), r"\1/\2"),)


def renamed_keys(keys: Iterable[str], current: Collection[str]) -> dict[str, str]:
    """``{old: new}`` for each of ``keys`` that this version does not write (not in
    ``current``, the keys it writes) and that a rename of :data:`RENAMED` turns into one it
    writes; a key this version writes is never renamed.

    Example:
      >>> renamed_keys(["loss", "layer_mode/1/fc2/kernel"], ["loss", "layer_mode/fc2/kernel"])
      {'layer_mode/1/fc2/kernel': 'layer_mode/fc2/kernel'}
    """
    out = {}
    for k in keys:
        for pattern, replacement in RENAMED:
            if k not in current and pattern.fullmatch(k):
                new = pattern.sub(replacement, k)
                if new in current:
                    out[k] = new
    return out


def window_mean(
    window: Sequence[Mapping[str, float]],
    current: Collection[str],
    defaults: Mapping[str, float] | None = None,
) -> tuple[dict[str, float], list[str]]:
    """A train record from the per-step metrics since the last one: each key's mean over the
    steps that hold it (a step without a key of ``defaults`` counts its default, once another
    step holds it), in the order the keys first appear.

    Steps restored from a checkpoint written by an older version count under their key's
    current spelling (:func:`renamed_keys`, ``current``: the keys this version's steps write);
    a key of an old spelling with no current one (its metric since removed) is left out of the
    record and returned, for the run to say so.

    Returns:
      ``(record, keys left out)``.

    Example:
      >>> window_mean([{"loss": 1.0, "rank/0/fc": 2.0}, {"loss": 2.0, "rank/fc": 4.0}],
      ...             ["loss", "rank/fc"])
      ({'loss': 1.5, 'rank/fc': 3.0}, [])
    """
    keys = {k for w in window for k in w}
    names = renamed_keys(keys, current)
    lost = sorted(
        k for k in keys - set(names) - set(current) if any(p.fullmatch(k) for p, _ in RENAMED)
    )
    values: dict[str, list[float]] = {}
    for w in window:
        for k, v in w.items():
            if k not in lost:
                values.setdefault(names.get(k, k), []).append(v)
    for k, v in (defaults or {}).items():
        if k in values:
            values[k] = [w.get(k, v) for w in window]
    return {k: float(np.mean(v)) for k, v in values.items()}, lost


def _plain(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    if math.isfinite(f) and f == int(f) and abs(f) < 2**53 and not isinstance(v, float):
        return int(f)
    return f


class MetricWriter:
    """Appends one record per call to ``metrics.jsonl`` and per split to ``<split>.csv``.

    Records are ``{"step": int, "split": "train" | "eval" | "links", **scalars}``. A run that
    starts calls :meth:`truncate_after` with the step it resumes from (0 for a fresh start), so
    the files never hold a step twice nor rows of an earlier attempt. A resumed run repeats the
    train and eval records bit for bit; ``links`` records (the link probe's times,
    :mod:`jaxcomp.train._link_probe`, written only when ``config.link_probe_every`` asks) are
    wall-clock measurements, measured afresh.

    Every record also goes to the writers named in ``writers`` (:mod:`jaxcomp.train._writers`:
    ``"tensorboard"``, ``"wandb"``), opened by :meth:`truncate_after`, as ``<split>/<key>``
    scalars.

    Args:
      workdir: the run directory.
      enabled: write at all (only process 0 writes).
      writers: names of writers beside the files (checked by ``_writers.check``).
      config: the experiment config as JSON-able data, handed to the writers.
    """

    def __init__(
        self,
        workdir: str,
        enabled: bool = True,
        writers: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
    ):
        self.workdir, self.enabled = workdir, enabled
        self.jsonl = os.path.join(workdir, "metrics.jsonl")
        self.writer_names, self.config = tuple(writers), config
        self.writers: list = []
        self.timing = os.path.join(workdir, TIMING)
        self._spelled: set[str] = set()  # the splits whose records on file use current names

    def truncate_after(self, step: int) -> None:
        """Drops records with ``step > step`` (``0``: all), rewriting each file atomically."""
        if not self.enabled:
            return
        keep = [r for r in read_metrics(self.workdir) if r["step"] <= step]
        self._rewrite(keep, {r["split"] for r in keep} | {"train", "eval"})
        times = [r for r in read_metrics(self.workdir, TIMING) if r["step"] <= step]
        _replace(self.timing, "".join(json.dumps(r) + "\n" for r in times))
        self._spelled = set()
        self.close()
        self.writers = _writers.open_writers(self.writer_names, self.workdir, step, self.config)

    def find(self, step: int, split: str) -> dict | None:
        """The record of ``split`` at ``step``, if written."""
        for r in read_metrics(self.workdir):
            if r["step"] == step and r["split"] == split:
                return r
        return None

    def write(
        self,
        step: int,
        split: str,
        scalars: Mapping[str, Any],
        step_time_s: float | None = None,
    ) -> None:
        """Appends one record; ``step_time_s`` (the mean seconds of a step since the last
        record) goes to the writers only, so that the files of a resumed run match."""
        if not self.enabled:
            return
        record = {"step": int(step), "split": split, **{k: _plain(v) for k, v in scalars.items()}}
        if split not in self._spelled:  # the first record of the split in this run
            self._respell(split, record)
            self._spelled.add(split)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._csv(record)
        if self.writers:
            tags = _writers.tagged(split, record)
            tags.pop(f"{split}/step", None)
            if step_time_s is not None:
                tags[f"{split}/step_time_s"] = float(step_time_s)
            for w in self.writers:
                w.write(step, tags)

    def write_summary(self, step: int, summary: Mapping[str, Any]) -> None:
        """The summary's numbers and per-kind collective bytes to the writers, at ``step``."""
        scalars = _writers.summary_scalars(summary)
        for w in self.writers:
            w.write(step, scalars)

    def close(self) -> None:
        """Closes the writers (the files need no closing)."""
        for w in self.writers:
            w.close()
        self.writers = []

    def write_time(self, step: int, step_s: float, elapsed_s: float) -> None:
        """Appends ``{"step", "step_s", "elapsed_s"}`` to ``timing.jsonl``: the wall time of
        training step ``step`` (its batch fetched to its metrics on the host) and since the run
        started. Apart from ``metrics.jsonl``, whose records a resumed run repeats bit for bit."""
        if self.enabled:
            with open(self.timing, "a") as f:
                f.write(json.dumps({"step": int(step), "step_s": step_s, "elapsed_s": elapsed_s}))
                f.write("\n")

    def _respell(self, split: str, record: dict) -> None:
        """Renames the keys of ``split``'s records on file that this run writes under another
        name (:func:`renamed_keys`; a run resumed from before a rename)."""
        records = read_metrics(self.workdir)
        names = renamed_keys({k for r in records if r["split"] == split for k in r}, record)
        if names:
            respelled = [
                {names.get(k, k): v for k, v in r.items()} if r["split"] == split else r
                for r in records
            ]
            self._rewrite(respelled, {split})
            for w in self.writers:
                if not w.takes_earlier_steps:
                    continue
                for r in records:  # the earlier steps again, under the current names only
                    if r["split"] == split:
                        w.write(
                            r["step"],
                            _writers.tagged(split, {names[k]: r[k] for k in names if k in r}),
                        )

    def _rewrite(self, records: list[dict], splits: set[str]) -> None:
        """``metrics.jsonl`` as ``records``, and the CSV of each of ``splits`` from them."""
        _replace(self.jsonl, "".join(json.dumps(r) + "\n" for r in records))
        for split in splits:
            _write_csv(self.workdir, split, [r for r in records if r["split"] == split])

    def _csv(self, record: dict) -> None:
        path = os.path.join(self.workdir, f"{record['split']}.csv")
        fields = [k for k in record if k != "split"]
        if os.path.exists(path):
            with open(path) as f:
                header = f.readline().strip().split(",")
            if set(fields) - set(header):  # a column appeared: every row again, with it
                rows = [r for r in read_metrics(self.workdir) if r["split"] == record["split"]]
                _write_csv(self.workdir, record["split"], rows)
                return
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=header, extrasaction="ignore").writerow(record)
            return
        _write_csv(self.workdir, record["split"], [record])


def _write_csv(workdir: str, split: str, rows: list[dict]) -> None:
    """``<split>.csv`` of ``rows`` (none: no file), its columns every key of theirs in the order
    they first appear (an empty cell where a row has none)."""
    path = os.path.join(workdir, f"{split}.csv")
    if not rows:
        if os.path.exists(path):
            os.remove(path)
        return
    fields = list(dict.fromkeys(k for r in rows for k in r if k != "split"))
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def _replace(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_metrics(workdir: str, name: str = "metrics.jsonl") -> list[dict]:
    """All records of ``workdir/metrics.jsonl`` (or of ``name``: :data:`TIMING`; empty if none).

    A last line cut short (a process killed while writing it) is dropped.

    Raises:
      ValueError: naming the file and line if any other line is not a JSON record.
    """
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    out = []
    for n, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines) - 1 and not line.endswith("\n"):
                break
            raise ValueError(f"{path} line {i} is not a JSON record: {line[:80]!r}") from None
        out.append(record)
    return out


def plot_metrics(workdir: str, path: str | None = None) -> str | None:
    """Draws loss and accuracy curves (train, and eval with compression on/off) to a PNG.

    Returns:
      The PNG path, or ``None`` if there is nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(workdir)
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    if not train and not evals:
        return None
    path = path or os.path.join(workdir, "metrics.png")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    both = any("accuracy_uncompressed" in r for r in evals)
    series = [(train, "", "train", "C0", "-")]
    series.append((evals, "", "eval, compression on" if both else "eval", "C1", "o-"))
    series.append((evals, "_uncompressed", "eval, compression off", "C2", "o-"))
    for records, suffix, label, color, style in series:
        for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
            pts = [(r["step"], r[key + suffix]) for r in records if key + suffix in r]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=label, alpha=0.85)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def summary_table(rows: Sequence[tuple[str, Any]], title: str = "summary") -> str:
    """A two-column text table."""
    rows = [(str(k), v if isinstance(v, str) else _fmt(v)) for k, v in rows]
    w = max(len(k) for k, _ in rows)
    v = max(len(x) for _, x in rows)
    line = "+" + "-" * (w + 2) + "+" + "-" * (v + 2) + "+"
    out = [line, f"| {title:<{w + v + 3}} |", line]
    out += [f"| {k:<{w}} | {x:>{v}} |" for k, x in rows]
    out.append(line)
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
