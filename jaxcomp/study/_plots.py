"""PNG plots of a study: accuracy against bytes per step, curves, and mode / phase over time."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, dpi: int = 80) -> str:
    """Saves ``fig`` as a 256-colour PNG (a few lines and markers: ~3x smaller than RGBA, small
    enough to commit)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256)
    small.save(path, optimize=True)
    return path


def _combo_label(row: dict[str, Any], axes: Sequence[str]) -> str:
    return ", ".join(f"{a}={row.get(a)}" for a in axes) or "all"


def plot_accuracy_vs_bytes(
    rows: list[dict[str, Any]], axes: Sequence[str], path: str
) -> str | None:
    """Final test accuracy against bytes per step: one point per variant, error bars over seeds.

    Filled markers: compression on at evaluation (where the mode has it); hollow: off. One colour
    per combination of axis values (e.g. the optimizer).
    """
    rows = [r for r in rows if r.get("wire_bytes") and r.get("final_acc_off") is not None]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    combos = sorted({_combo_label(r, axes) for r in rows})
    for i, combo in enumerate(combos):
        color = f"C{i % 10}"
        for r in (r for r in rows if _combo_label(r, axes) == combo):
            x = r["wire_bytes"]
            xerr = r.get("wire_bytes_std") or 0.0
            if r.get("final_acc_on") is not None:
                ax.errorbar(x, r["final_acc_on"], yerr=r["final_acc_on_std"], xerr=xerr, fmt="o",
                            color=color, capsize=3)  # fmt: skip
            ax.errorbar(x, r["final_acc_off"], yerr=r["final_acc_off_std"], xerr=xerr, fmt="o",
                        mfc="none", color=color, capsize=3)  # fmt: skip
            y = r["final_acc_on"] if r.get("final_acc_on") is not None else r["final_acc_off"]
            ax.annotate(r["variant"], (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=color)  # fmt: skip
        ax.plot([], [], "o", color=color, label=combo)
    ax.plot([], [], "o", color="gray", label="compression on at evaluation")
    ax.plot([], [], "o", mfc="none", color="gray", label="compression off")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per step (per device, on the mode's mesh axis)")
    ax.set_ylabel("final test accuracy (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path, dpi=90)


def _mean_curve(runs, split: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for rec in run.evals if split == "eval" else run.train:
            if key in rec and rec[key] is not None:
                by_step.setdefault(int(rec["step"]), []).append(float(rec[key]))
    return [(s, statistics.fmean(v)) for s, v in sorted(by_step.items())]


def plot_curves(runs: list, axes: Sequence[str], path: str) -> str | None:
    """Per combination of axis values: eval accuracy and train loss against step (mean of seeds)."""
    runs = [r for r in runs if r.train or r.evals]
    if not runs:
        return None
    plt = _pyplot()
    combos = sorted({tuple(r.axes.get(a) for a in axes) for r in runs}, key=str)
    fig, grid = plt.subplots(2, len(combos), figsize=(5.5 * len(combos), 7.5), squeeze=False)
    variants = list(dict.fromkeys(r.variant for r in runs))
    for j, combo in enumerate(combos):
        ax_acc, ax_loss = grid[0][j], grid[1][j]
        for i, variant in enumerate(variants):
            group = [
                r
                for r in runs
                if r.variant == variant and tuple(r.axes.get(a) for a in axes) == combo
            ]
            color = f"C{i % 10}"
            on = _mean_curve(group, "eval", "accuracy_uncompressed")
            if on:  # the mode evaluates with compression on and off
                ax_acc.plot(*zip(*_mean_curve(group, "eval", "accuracy")), "o-", color=color,
                            label=f"{variant} (on)")  # fmt: skip
                ax_acc.plot(*zip(*on), "o--", color=color, alpha=0.6, label=f"{variant} (off)")
            elif _mean_curve(group, "eval", "accuracy"):
                ax_acc.plot(*zip(*_mean_curve(group, "eval", "accuracy")), "o-", color=color,
                            label=variant)  # fmt: skip
            loss = _mean_curve(group, "train", "loss")
            if loss:
                ax_loss.plot(*zip(*loss), "-", color=color, label=variant)
        title = ", ".join(f"{a}={v}" for a, v in zip(axes, combo)) or "all"
        ax_acc.set_title(title, fontsize=9)
        ax_acc.set_ylabel("test accuracy")
        ax_loss.set_ylabel("train loss")
        ax_loss.set_yscale("log")
        for ax in (ax_acc, ax_loss):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    return _save(fig, path)


#: train metrics that show an adaptive method's state over time, and their labels
STATE_METRICS = {
    "low_compression_leaves": "Accordion: layers in low compression",
    "every_k": "Accordion: micro-batches per update",
    "phase": "AB: phase (mean over the log window)",
    "mean_rank": "AB: mean rank of the factored layers",
    "compression_ratio": "AB: parameter compression ratio",
    "wire_bytes": "bytes per step",
}


def plot_state(runs: list, path: str) -> str | None:
    """Accordion's low-compression layer count and AB's phase / rank / ratio against step.

    Drawn only when the runs log ``low_compression_leaves``, ``every_k`` or ``phase``
    (data-parallel Accordion, its batch-size variant and AB-Training modes); one line per run
    (seeds are not averaged: switches happen at different steps).
    """
    keys = [
        k for k in STATE_METRICS if k != "wire_bytes" and any(k in t for r in runs for t in r.train)
    ]
    if not keys:
        return None
    keys.append("wire_bytes")
    plt = _pyplot()
    fig, axs = plt.subplots(len(keys), 1, figsize=(8, 2.4 * len(keys)), squeeze=False)
    # a colour per variant and axes combination (AB with Adam, AB with SGD-momentum, ...), a
    # line style per seed: every run is told apart, not only the variants
    combos = list(dict.fromkeys(_state_combo(r) for r in runs))
    seeds = sorted({r.seed for r in runs})
    styles = ("-", "--", ":", "-.")
    for ax, key in zip((a[0] for a in axs), keys):
        for run in runs:
            pts = [(t["step"], t[key]) for t in run.train if t.get(key) is not None]
            if pts:
                color = f"C{combos.index(_state_combo(run)) % 10}"
                style = styles[seeds.index(run.seed) % len(styles)]
                ax.plot(*zip(*pts), style, color=color, alpha=0.7, label=run.name)
        ax.set_ylabel(STATE_METRICS[key], fontsize=8)
        ax.grid(alpha=0.3)
    axs[-1][0].set_xlabel("step")
    axs[0][0].legend(fontsize=5, ncol=2)
    return _save(fig, path)


def _state_combo(run) -> tuple:
    return (run.variant, *sorted(run.axes.items()))


def all_plots(rows, runs, axes, out_dir: str) -> dict[str, str]:
    """Writes every plot that has data into ``out_dir``; ``{name: path}``."""
    made = {
        "accuracy_vs_bytes": plot_accuracy_vs_bytes(
            rows, axes, os.path.join(out_dir, "accuracy_vs_bytes.png")
        ),
        "curves": plot_curves(runs, axes, os.path.join(out_dir, "curves.png")),
        "state": plot_state(runs, os.path.join(out_dir, "state.png")),
    }
    return {k: v for k, v in made.items() if v}
