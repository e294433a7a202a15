"""Config overrides by dotted key: ``apply_overrides(config, {"pipeline.forward.fraction": 0.05})``.

One function serves the CLI (``--set KEY=VALUE``, the value parsed as a Python literal) and
Python callers such as a study's grid, whose named presets are plain override dicts::

  PRESETS = {
      "forward-only": {"pipeline.forward": {"name": "top_k", "fraction": 0.1},
                       "pipeline.backward": "identity"},
      "both": {"pipeline.forward.fraction": 0.1, "pipeline.backward.fraction": 0.1},
  }
  config = apply_overrides(get_config(), {**PRESETS["forward-only"], "seed": 1})

A codec spec given as a bare name (``forward = "top_k"``) becomes ``{"name": "top_k", ...}``
when a dotted key descends into it. Every key and value is checked before anything is built,
and an error names the key.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxcomp.train import _config

#: sections whose keys are free-form keyword arguments (checked by the builder they feed)
FREE_SECTIONS = ("model", "data", "eval_data", "optax")
#: dotted keys that hold a codec or channel spec: a bare name or ``{"name": ..., **kwargs}``
CODEC_SPECS = (
    "pipeline.forward",
    "pipeline.backward",
    "pipeline.forward_high",
    "pipeline.backward_high",
    "data_parallel.codec",
    "data_parallel.low",
    "data_parallel.high",
)
#: keys a channel spec takes besides the codec's own arguments
CHANNEL_KEYS = ("name", "feedback", "per_sample_buffers")


def _section_defaults(section: str) -> dict[str, Any] | None:
    """The allowed keys and defaults of a mode's sub-config, or ``None`` if free-form."""
    if section == "pipeline":
        from jaxcomp.train._pipeline_config import PIPELINE_DEFAULTS

        return PIPELINE_DEFAULTS
    if section == "data_parallel":
        from jaxcomp.train._dp_mode import DP_DEFAULTS

        return DP_DEFAULTS
    if section == "ab":
        from jaxcomp.train._ab_mode import AB_DEFAULTS

        return AB_DEFAULTS
    return None


def _plain(value: Any) -> Any:
    """Deep copy with ``ConfigDict``s and mappings as plain dicts."""
    if isinstance(value, ml_collections.ConfigDict):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _kind(value: Any) -> str | None:
    """The value's kind for type checks, or ``None`` when any value may replace it."""
    if value is None or value is _config.REQUIRED or value is inspect.Parameter.empty:
        return None
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list or tuple"
    if isinstance(value, Mapping):
        return "a dict"
    return None


def _describe(value: Any) -> str:
    kind = _kind(value) or type(value).__name__
    return f"{kind} ({value!r})"


def _check_value(
    key: str, value: Any, current: Any, default: Any = None, codec_spec: bool = False
) -> None:
    """``value`` must be of the current value's kind; ``None`` only where the default is."""
    if value is None and _kind(default) is not None:
        raise ValueError(f"config.{key} cannot be None (its default is {default!r}).")
    if codec_spec:
        if value is None:  # only where the default is None (checked above): the link is off
            return
        if not isinstance(value, (str, Mapping)):
            raise ValueError(
                f"config.{key} is a codec spec: a codec name or a dict "
                f"{{'name': ..., **arguments}}; got {_describe(value)}."
            )
        return
    want, got = _kind(current), _kind(value)
    if want is None or value is None or want == got:
        return
    raise ValueError(
        f"config.{key} must be {want} (like its current value {current!r}); got {_describe(value)}."
    )


def _default(path: list[str]) -> Any:
    """The default of a top-level or mode sub-config key (``None`` if it has none)."""
    if len(path) == 1:
        return _config.DEFAULTS.get(path[0])
    if len(path) == 2:
        table = _section_defaults(path[0])
        if table is not None:
            return _plain(table.get(path[1]))
    return None


def _current(path: list[str], node: dict) -> Any:
    """The value at ``path`` in the config (``node`` is its parent), else its default."""
    return node[path[-1]] if path[-1] in node else _default(path)


def _check_known(path: list[str]) -> None:
    """Unknown top-level keys and unknown keys of a mode's sub-config are errors."""
    dotted = ".".join(path)
    if len(path) == 1 and path[0] not in _config.DEFAULTS:
        raise ValueError(
            f"unknown config key {dotted!r}; allowed keys are {sorted(_config.DEFAULTS)}."
        )
    if len(path) == 2:
        table = _section_defaults(path[0])
        if table is not None and path[1] not in table:
            raise ValueError(
                f"unknown config key {dotted!r}; config.{path[0]} takes {sorted(table)}."
            )


def _split(key: Any) -> list[str]:
    parts = key.split(".") if isinstance(key, str) else []
    if not parts or not all(p.isidentifier() for p in parts):
        raise ValueError(
            f"malformed config key {key!r}: use dotted names, e.g. 'pipeline.forward.fraction'."
        )
    return parts


def _check_codec_spec(key: str, spec: Any) -> None:
    """Checks a codec spec's name and that every other key is an argument of that codec."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        _check_value(key, spec, None, codec_spec=True)
    name = spec.get("name")
    if name is None:
        raise ValueError(
            f"config.{key} has no codec name: set config.{key} to a codec name first "
            f"(e.g. '{key}=top_k' before '{key}.fraction=0.1') or give the whole spec dict."
        )
    if name not in _config.CODECS:
        raise ValueError(
            f"config.{key}.name: unknown codec {name!r}; allowed codecs are {list(_config.CODECS)}."
        )
    from jaxcomp import compressors

    params = inspect.signature(getattr(compressors, name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for arg, value in spec.items():
        if arg in CHANNEL_KEYS:
            continue
        if arg not in params:
            allowed = sorted(set(params) | set(CHANNEL_KEYS))
            raise ValueError(f"unknown config key '{key}.{arg}': codec {name} takes {allowed}.")
        default = params[arg].default
        _check_value(f"{key}.{arg}", value, default, default)


def apply_overrides(
    config: ml_collections.ConfigDict | Mapping[str, Any], overrides: Mapping[str, Any]
) -> ml_collections.ConfigDict:
    """A copy of ``config`` with each dotted key of ``overrides`` set to its Python value.

    Keys are applied in order; ``"a.b.c": v`` sets ``config.a.b.c = v``, creating the dicts on
    the way (from the key's default, e.g. ``config.pipeline`` when the config has none), and
    turning a codec spec given as a bare name into ``{"name": name}`` first. A value replaces
    the whole sub-tree at its key (``"pipeline.forward": {...}`` is the complete spec).

    Checks, each a ``ValueError`` naming the key: a key that is not a config key (top-level,
    a mode's sub-config, or an argument of the codec named at a codec spec); a value of
    another kind than the current one or the default (a number, string, bool, list or dict;
    ``None`` and required keys take anything); a key that descends into a value that is not a
    dict (``lr.x``); a key that replaces a deeper key given before it.

    Args:
      config: an experiment config (not modified).
      overrides: ``{dotted key: value}``, e.g. ``{"pipeline.forward.fraction": 0.05,
        "optax_name": "adam", "model.hidden": (64, 64)}``.

    Returns:
      A new ``ConfigDict``.

    Example:
      >>> import ml_collections
      >>> config = ml_collections.ConfigDict({"lr": 0.1, "pipeline": {"forward": "top_k"}})
      >>> c = apply_overrides(config, {"pipeline.forward.fraction": 0.05, "lr": 0.01})
      >>> c.pipeline.forward.to_dict(), c.lr
      ({'fraction': 0.05, 'name': 'top_k'}, 0.01)
    """
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping of dotted keys to values; got {overrides!r}.")
    tree = _plain(config)
    applied: list[list[str]] = []
    for key, value in overrides.items():
        path = _split(key)
        for earlier in applied:
            if len(earlier) > len(path) and earlier[: len(path)] == path:
                raise ValueError(
                    f"override {key!r} replaces {'.'.join(earlier)!r} given before it; give "
                    "the deeper keys after it, or one whole value."
                )
        node = tree
        for depth in range(1, len(path)):
            where = path[:depth]
            dotted = ".".join(where)
            _check_known(where)
            if where[-1] not in node:
                default = _current(where, node)
                node[where[-1]] = {} if default is None else _plain(default)
            child = node[where[-1]]
            if isinstance(child, str) and dotted in CODEC_SPECS:
                child = node[where[-1]] = {"name": child}
            if not isinstance(child, dict):
                raise ValueError(
                    f"cannot set {key!r}: config.{dotted} is {_describe(child)}, not a dict "
                    "of settings."
                )
            node = child
        _check_known(path)
        value = _plain(value)
        if len(path) <= 2 or path[0] not in FREE_SECTIONS:
            current, default = _current(path, node), _default(path)
            _check_value(key, value, current, default, codec_spec=key in CODEC_SPECS)
        node[path[-1]] = value
        applied.append(path)
    for spec_key in CODEC_SPECS:
        touched = any(".".join(p).startswith(spec_key) for p in applied)
        section, name = spec_key.split(".")
        if touched and tree.get(section, {}).get(name) is not None:
            _check_codec_spec(spec_key, tree[section][name])
    return ml_collections.ConfigDict(tree)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (the CLI's ``--set``) as ``{KEY: value}`` for :func:`apply_overrides`.

    ``VALUE`` is read as a Python literal (``0.05``, ``(64, 64)``, ``{'name': 'top_k'}``,
    ``None``, ``True``); anything that is not a literal is a string (``adam``, ``top_k``).
    A repeated key keeps its last value.

    Raises:
      ValueError: for an item without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE (e.g. lr=0.01); got {item!r}.")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text.strip()
        out.pop(key, None)
        out[key] = value
    return out
