"""Runs a study's cells one after another, each in its own workdir; a rerun continues.

``DIR/study.json`` records the study, whether it is a smoke run, the extra overrides and every
cell's overrides; each cell's workdir holds the trainer's files and ``cell.json`` with the
cell's status: ``running`` (started, or killed: a rerun resumes it from its last checkpoint),
``done``, ``diverged`` (too many non-finite steps: recorded and not rerun) or ``failed`` (any
other error: recorded, the study goes on, and a rerun tries it again).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp import _stamp
from jaxcomp.study import _grid

STATUSES = ("running", "done", "diverged", "failed")
MANIFEST = "study.json"
CELL_FILE = "cell.json"


def _jsonable(value: Any) -> Any:
    """Overrides as JSON (tuples become lists, so compare through this on both sides)."""
    return json.loads(json.dumps(value, default=repr))


def read_manifest(workdir: str) -> dict[str, Any]:
    """The study's manifest in ``workdir`` (``ValueError`` if there is none or it is damaged)."""
    path = os.path.join(workdir, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{workdir!r} holds no study ({MANIFEST} missing): run the study first.")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}).") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("cells"), list):
        raise ValueError(f"{path} is not a study manifest.")
    return manifest


def read_cell_status(cell_dir: str) -> dict[str, Any] | None:
    """A cell's ``cell.json`` (``None`` if it never started)."""
    path = os.path.join(cell_dir, CELL_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {"status": "running"}  # killed while writing it: rerun the cell


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, default=repr)
    os.replace(tmp, path)  # atomic: a kill never leaves half a file


def _check_manifest(workdir: str, manifest: dict, study: _grid.Study) -> None:
    path = os.path.join(workdir, MANIFEST)
    if not os.path.exists(path):
        return
    old = read_manifest(workdir)
    for key in ("study", "smoke", "extra", "preset"):
        if old.get(key) != manifest[key]:
            raise ValueError(
                f"{workdir!r} holds study {old.get('study')!r} (smoke={old.get('smoke')}, "
                f"extra={old.get('extra')}, preset={old.get('preset')}); this run is "
                f"{manifest['study']!r} (smoke={manifest['smoke']}, extra={manifest['extra']}, "
                f"preset={manifest['preset']}): use another --workdir."
            )
    before = {c["name"]: c["overrides"] for c in old["cells"]}
    for cell in manifest["cells"]:
        if cell["name"] in before and before[cell["name"]] != cell["overrides"]:
            raise ValueError(
                f"cell {cell['name']!r} of {study.path} changed since {workdir!r} was started "
                f"(was {before[cell['name']]}); use another --workdir or delete that cell's folder."
            )


def run_study(
    study: _grid.Study,
    workdir: str,
    *,
    smoke: bool = False,
    extra: Mapping[str, Any] | None = None,
    preset: str | None = None,
    only: Sequence[str] = (),
    train_fn=None,
    log=print,
) -> dict[str, str]:
    """Runs every cell of ``study`` not yet finished, one after another, in ``workdir/CELL``.

    Every cell's config is built and checked before the first run starts, so a typo in a study
    fails at once. A cell that diverges or fails is recorded and the study goes on.

    Args:
      study: a loaded study (:func:`load_study`).
      workdir: the study's folder; created if missing; a rerun continues where it stopped.
      smoke: run every cell for 2 steps (:data:`SMOKE`); a smoke study and a full one never
        share a workdir.
      extra: overrides for every cell (applied last), e.g. from ``--set``.
      preset: ``"forward-only"``, ``"backward-only"`` or ``"both"``: every cell's codec moved
        to those directions (:func:`~jaxcomp.study._grid.preset_overrides`); a preset study and
        another never share a workdir.
      only: shell-style patterns of the cell names to run now (``--cells``); the others are
        left as they are (the report shows them as missing until they run).
      train_fn: ``(config, workdir) -> summary``; default :func:`jaxcomp.train.train_and_evaluate`.
      log: where progress lines go.

    Returns:
      ``{cell name: status}`` of the chosen cells after this call.
    """
    extra = dict(extra or {})
    all_extra = {**extra, **(_grid.SMOKE if smoke else {})}
    grid = _grid.cells(study, all_extra)
    base = _grid.base_config(study)
    configs = {cell.name: _grid.cell_config(study, cell, base) for cell in grid}
    if preset is not None:
        moved = [_grid.preset_overrides(configs[c.name], preset) for c in grid]
        grid = [c._replace(overrides={**c.overrides, **m}) for c, m in zip(grid, moved)]
        configs = {cell.name: _grid.cell_config(study, cell, base) for cell in grid}
    chosen = {c.name for c in _grid.select(grid, only)}
    manifest = {
        "study": study.name,
        "doc": study.doc,
        "path": study.path,
        "config": study.config,
        "smoke": smoke,
        "extra": _jsonable(extra),
        "preset": preset,
        "baseline": study.baseline,
        "axes": list(study.axes),
        "cells": [
            {
                "name": c.name,
                "variant": c.variant,
                "axes": dict(c.axes),
                "seed": c.seed,
                "overrides": _jsonable(c.overrides),
            }
            for c in grid
        ],
    }
    _check_manifest(workdir, manifest, study)
    os.makedirs(workdir, exist_ok=True)
    _write_json(os.path.join(workdir, MANIFEST), manifest)
    if train_fn is None:
        from jaxcomp import train

        train_fn = train.train_and_evaluate
    statuses: dict[str, str] = {}
    for i, cell in enumerate(grid, 1):
        if cell.name not in chosen:
            continue
        cell_dir = os.path.join(workdir, cell.name)
        previous = read_cell_status(cell_dir)
        if previous and previous.get("status") in ("done", "diverged"):
            statuses[cell.name] = previous["status"]
            log(f"[{i}/{len(grid)}] {cell.name}: {previous['status']} already")
            continue
        os.makedirs(cell_dir, exist_ok=True)
        record = {"status": "running", "overrides": manifest["cells"][i - 1]["overrides"]}
        record["stamp"] = _stamp.stamp()  # the commit and versions this cell ran with
        _write_json(os.path.join(cell_dir, CELL_FILE), record)
        log(f"[{i}/{len(grid)}] {cell.name}: running")
        t0 = time.perf_counter()
        try:
            train_fn(configs[cell.name], cell_dir)
            record["status"] = "done"
        except Exception as e:  # a diverged or failed cell must not stop the others
            diverged = type(e).__name__ == "NonFiniteError"
            record.update(
                status="diverged" if diverged else "failed", error=f"{type(e).__name__}: {e}"
            )
        record["seconds"] = time.perf_counter() - t0
        _write_json(os.path.join(cell_dir, CELL_FILE), record)
        statuses[cell.name] = record["status"]
        note = f" ({record['error'].splitlines()[0]})" if "error" in record else ""
        log(f"[{i}/{len(grid)}] {cell.name}: {record['status']} in {record['seconds']:.0f} s{note}")
    return statuses
