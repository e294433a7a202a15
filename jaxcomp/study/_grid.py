"""A study: a base config, named variants and axes of override dicts, and seeds; its cells.

A study file (``configs/studies/NAME.py``) is plain Python: its docstring gives the command, the
expected runtime and the finding it tests, and it defines

* ``CONFIG``: the base experiment, a config in ``configs/`` (``"digits_pipeline"``, optionally
  ``"digits_pipeline:smoke"``) or a path;
* ``VARIANTS``: ``{name: overrides}``, the methods compared (one point each in the report);
* ``AXES`` (optional): ``{axis: {value: overrides}}``, e.g. the optimizer; every variant runs
  at every combination of axis values;
* ``SEEDS`` (optional, default ``(0,)``), ``COMMON`` (optional overrides for every cell) and
  ``BASELINE`` (optional, the variant the others are compared with, default the first).

Overrides are ``{dotted key: Python value}`` for :func:`jaxcomp.train.apply_overrides`. A cell's
overrides are ``COMMON``, then the variant's, then each axis value's, then ``{"seed": seed}``;
its name is made of the variant, axis values and seed (``topk-fwd__optimizer=adam__seed0``) and
names its workdir.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from jaxcomp import _pyfile
from jaxcomp import _resources

#: overrides that make every cell a 2-step smoke run (``--smoke``)
SMOKE = {"total_steps": 2, "log_every": 1, "eval_every": 0, "checkpoint_every": 0}


class Cell(NamedTuple):
    """One run of a study: its workdir name, where it sits in the grid, and its overrides."""

    name: str
    variant: str
    axes: tuple[tuple[str, str], ...]
    seed: int
    overrides: dict[str, Any]


class Study(NamedTuple):
    """A parsed study file (see the module docstring)."""

    name: str
    doc: str
    config: str
    variants: dict[str, dict[str, Any]]
    axes: dict[str, dict[str, dict[str, Any]]]
    seeds: tuple[int, ...]
    common: dict[str, Any]
    baseline: str
    path: str


OPTIMIZERS = {
    "adam": {"optax_name": "adam", "optax": {}, "lr": 1e-3},
    "sgdm": {"optax_name": "sgd", "optax": {"momentum": 0.9}, "lr": 0.05},
}


def optimizer_axis(*names: str, lr: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """The optimizer axis of the paper studies: Adam (lr 1e-3) and SGD with momentum 0.9 (lr 0.05).

    Args:
      names: which optimizers of :data:`OPTIMIZERS`, in the order the study runs them
        (default: all, Adam first).
      lr: learning rates other than the presets' for some of them, e.g. ``{"adam": 3e-3}``.

    Returns:
      ``{name: overrides}``, fresh dicts to use as ``AXES["optimizer"]``.

    Example:
      >>> list(optimizer_axis("sgdm", "adam"))
      ['sgdm', 'adam']
      >>> optimizer_axis("adam")["adam"]["lr"]
      0.001
      >>> optimizer_axis("adam", "sgdm", lr={"sgdm": 0.1})["sgdm"]["lr"]
      0.1
    """
    lr = dict(lr or {})
    unknown = [n for n in [*names, *lr] if n not in OPTIMIZERS]
    if unknown:
        raise ValueError(
            f"optimizer_axis: unknown optimizer(s) {unknown}; known: {list(OPTIMIZERS)}"
        )
    return {n: {**OPTIMIZERS[n], **({"lr": lr[n]} if n in lr else {})} for n in names or OPTIMIZERS}


def direction_presets(codec: Any, other: Any = "identity") -> dict[str, dict[str, Any]]:
    """Named presets for a pipeline codec: ``forward-only``, ``backward-only`` and ``both``.

    Args:
      codec: a codec spec (a name or ``{"name": ..., **kwargs}``) for the compressed direction(s).
      other: the spec of the uncompressed direction.

    Returns:
      ``{preset: overrides}``, plain dicts to use as study variants.

    Example:
      >>> direction_presets("sign")["backward-only"]
      {'pipeline.forward': 'identity', 'pipeline.backward': 'sign'}
    """
    return {
        "forward-only": {"pipeline.forward": codec, "pipeline.backward": other},
        "backward-only": {"pipeline.forward": other, "pipeline.backward": codec},
        "both": {"pipeline.forward": codec, "pipeline.backward": codec},
    }


#: the CLI's ``--preset`` names (see :func:`preset_overrides`)
PRESETS = ("forward-only", "backward-only", "both")


def _is_identity(spec: Any) -> bool:
    name = spec if isinstance(spec, str) else dict(spec).get("name")
    return name in (None, "identity")


def preset_overrides(config, preset: str) -> dict[str, Any]:
    """Overrides moving a pipeline config's codec to the named direction(s) (``--preset``).

    The codec is the config's ``pipeline.forward`` one, or its ``pipeline.backward`` one when
    the forward is ``identity``; a config with both directions ``identity`` is left as it is
    (an uncompressed baseline stays one). So ``--preset forward-only`` turns a study of codec
    levels on both directions into the same study on the activations only.

    Args:
      config: a full config (``mode = "pipeline"``).
      preset: one of :data:`PRESETS`.

    Returns:
      ``{"pipeline.forward": ..., "pipeline.backward": ...}`` (``{}`` for an uncompressed one).

    Raises:
      ValueError: for an unknown preset, a config not in pipeline mode, or one with
        per-boundary codecs (``pipeline.boundaries``), which a preset cannot move.

    Example:
      >>> import ml_collections
      >>> c = ml_collections.ConfigDict({"mode": "pipeline", "pipeline": {"forward": "sign"}})
      >>> preset_overrides(c, "backward-only")
      {'pipeline.forward': 'identity', 'pipeline.backward': 'sign'}
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; the presets are {list(PRESETS)}.")
    if config.get("mode") != "pipeline":
        raise ValueError(f"preset {preset!r} needs mode 'pipeline'; got {config.get('mode')!r}.")
    pipe = dict(config.get("pipeline") or {})
    if pipe.get("boundaries") is not None:
        raise ValueError(
            f"preset {preset!r} cannot move per-boundary codecs (pipeline.boundaries)."
        )
    fwd, bwd = pipe.get("forward", "identity"), pipe.get("backward", "identity")
    if _is_identity(fwd) and _is_identity(bwd):
        return {}
    codec = bwd if _is_identity(fwd) else fwd
    codec = codec if isinstance(codec, str) else dict(codec)
    return direction_presets(codec)[preset]


def select(grid: list[Cell], patterns) -> list[Cell]:
    """The cells whose names match any of the shell-style ``patterns`` (all if none given).

    Raises:
      ValueError: if a pattern matches no cell (naming a few cell names).
    """
    if not patterns:
        return list(grid)
    out = []
    for pattern in patterns:
        hits = [c for c in grid if fnmatch.fnmatchcase(c.name, pattern)]
        if not hits:
            names = [c.name for c in grid[:3]]
            raise ValueError(f"--cells {pattern!r} matches no cell; cells are named like {names}.")
        out += [c for c in hits if c not in out]
    return [c for c in grid if c in out]


def repo_configs_dir() -> pathlib.Path:
    """The experiment configs (:func:`jaxcomp._resources.configs_dir`: the wheel's copy or the
    checkout's ``configs/``)."""
    return _resources.configs_dir()


def _find(spec: str, folder: pathlib.Path, what: str) -> pathlib.Path:
    path = pathlib.Path(spec)
    if path.suffix == ".py" and path.is_file():
        return path
    candidate = folder / f"{spec}.py"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
    raise ValueError(f"unknown {what} {spec!r}: no {candidate}; known: {known}.")


def _overrides(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{where} must be a dict of dotted keys to values; got {value!r}.")
    return dict(value)


def load_study(spec: str, studies_dir: str | os.PathLike | None = None) -> Study:
    """Reads a study file by name (``configs/studies/NAME.py``) or path and checks its shape.

    Raises:
      ValueError: naming the file and what is missing or malformed.
    """
    folder = pathlib.Path(studies_dir) if studies_dir else repo_configs_dir() / "studies"
    path = _find(spec, folder, "study")
    module = _pyfile.run_file(path, f"jaxcomp_study_{path.stem}")
    where = f"study {path}"
    doc = (module.__doc__ or "").strip()
    if "python -m jaxcomp.study run" not in doc:
        raise ValueError(f"{where}: the docstring must give the command that runs it.")
    for key in ("CONFIG", "VARIANTS"):
        if not hasattr(module, key):
            raise ValueError(f"{where} defines no {key}.")
    variants = _overrides(f"{where}: VARIANTS", module.VARIANTS)
    if not variants:
        raise ValueError(f"{where}: VARIANTS is empty.")
    variants = {str(k): _overrides(f"{where}: VARIANTS[{k!r}]", v) for k, v in variants.items()}
    axes = {}
    for axis, values in _overrides(f"{where}: AXES", getattr(module, "AXES", {})).items():
        values = _overrides(f"{where}: AXES[{axis!r}]", values)
        if not values:
            raise ValueError(f"{where}: AXES[{axis!r}] has no values.")
        axes[axis] = {
            str(k): _overrides(f"{where}: AXES[{axis!r}][{k!r}]", v) for k, v in values.items()
        }
    seeds = tuple(getattr(module, "SEEDS", (0,)))
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"{where}: SEEDS must be a non-empty tuple of ints; got {seeds!r}.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: SEEDS has duplicates: {seeds!r}.")
    baseline = getattr(module, "BASELINE", next(iter(variants)))
    if baseline not in variants:
        raise ValueError(f"{where}: BASELINE {baseline!r} is not a variant ({list(variants)}).")
    if not isinstance(module.CONFIG, str):
        raise ValueError(f"{where}: CONFIG must be a config name or path; got {module.CONFIG!r}.")
    common = _overrides(f"{where}: COMMON", getattr(module, "COMMON", {}))
    return Study(path.stem, doc, module.CONFIG, variants, axes, seeds, common, baseline, str(path))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-") or "x"


def cells(study: Study, extra: Mapping[str, Any] | None = None) -> list[Cell]:
    """Every run of ``study`` in order (variants, then axis values, then seeds varying fastest).

    Args:
      study: a loaded study.
      extra: overrides applied last to every cell (the CLI's ``--set``, or :data:`SMOKE`).

    Raises:
      ValueError: if two cells would share a workdir name.
    """
    axis_items = [[(axis, v) for v in values] for axis, values in study.axes.items()]
    out, seen = [], {}
    for variant, overrides in study.variants.items():
        for combo in itertools.product(*axis_items):
            for seed in study.seeds:
                merged = {**study.common, **overrides}
                for axis, value in combo:
                    merged.update(study.axes[axis][value])
                merged["seed"] = seed
                merged.update(extra or {})
                parts = [_slug(variant)] + [f"{_slug(a)}={_slug(v)}" for a, v in combo]
                name = "__".join([*parts, f"seed{seed}"])
                key = (variant, combo, seed)
                if name in seen:
                    raise ValueError(f"cells {seen[name]} and {key} share the name {name!r}.")
                seen[name] = key
                out.append(Cell(name, variant, tuple(combo), seed, merged))
    return out


def base_config(study: Study):
    """The study's base config (``CONFIG``, with its ``:arg``), as ``get_config`` returns it."""
    name, _, arg = study.config.partition(":")
    path = _find(name, repo_configs_dir(), "config")
    module = _pyfile.run_file(path, f"jaxcomp_study_{path.stem}")
    if not hasattr(module, "get_config"):
        raise ValueError(f"config {path} has no get_config(arg).")
    return module.get_config(arg or None)


def cell_config(study: Study, cell: Cell, base=None):
    """The full, validated config of one cell (``ValueError`` naming the cell otherwise)."""
    from jaxcomp import train

    base = base_config(study) if base is None else base
    try:
        return train.with_defaults(train.apply_overrides(base, cell.overrides))
    except ValueError as e:
        raise ValueError(f"study {study.name}, cell {cell.name}: {e}") from e
