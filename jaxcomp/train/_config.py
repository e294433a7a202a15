"""Experiment configs: the allowed keys, their defaults, and what they resolve to.

A config is an ``ml_collections.ConfigDict`` whose parts are chosen by name against public
modules (big_vision's habit): ``model_name`` in :data:`jaxcomp.models.MODELS`, ``data_name`` in
:func:`jaxcomp.data.get_dataset`, ``optax_name`` an ``optax`` optimizer. :func:`validate` checks
every key before anything is built, so a typo is a one-line error rather than a silent default.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import ml_collections
import optax

from jaxcomp import _validate
from jaxcomp.models import _staged
from jaxcomp.train import _extras
from jaxcomp.train import _writers

MODES = ("dense", "pipeline", "data_parallel", "ab")
SCHEDULES = ("constant", "cosine", "warmup_cosine", "step")

REQUIRED = "<required>"
#: top-level keys and their defaults
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "mode": REQUIRED,
    "mesh": REQUIRED,
    "model_name": REQUIRED,
    "model": {},
    "data_name": REQUIRED,
    "data": {},
    "eval_data": {},
    "augment": None,
    "batch_size": REQUIRED,
    "eval_batch_size": None,
    "total_steps": REQUIRED,
    "schedule_steps": None,
    "optax_name": "sgd",
    "optax": {},
    "lr": 0.1,
    "schedule": "constant",
    "warmup_steps": 0,
    "lr_decay_steps": [],
    "grad_clip_norm": None,
    "weight_decay": 0.0,
    "log_every": 50,
    "eval_every": 0,
    "checkpoint_every": 0,
    "keep_checkpoints": 2,
    "max_nonfinite_in_a_row": 10,
    "link_probe_every": 0,  # with several processes: time each host's link (train/_link_probe.py)
    "link_probe_bytes": 1 << 18,
    "writers": (),  # metric writers beside the files: "tensorboard", "wandb" (train/_writers.py)
    "compute_dtype": "float32",
    "pipeline": {},
    "data_parallel": {},
    "ab": {},
}
#: keys added after workdirs were written: left out of the fingerprint at their default, so
#: that such a workdir resumes (its experiment.json has no such key)
LATER_KEYS = {"compute_dtype": "float32"}
#: schedules whose shape depends on a horizon (``schedule_steps``, default ``total_steps``)
HORIZON_SCHEDULES = ("cosine", "warmup_cosine")
#: keys that do not change what is computed (a workdir may be resumed with other values);
#: ``total_steps`` shapes a cosine schedule through ``schedule_steps``, which is recorded
RUN_ONLY_KEYS = (
    "total_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "max_nonfinite_in_a_row",
    "link_probe_every",
    "link_probe_bytes",
    "eval_batch_size",
    "eval_data",
    "writers",
)


def with_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Validates the keys of ``config`` and fills in defaults (returns a new, unlocked copy).

    Every numeric key is checked by type, sign and range (:data:`NUMBERS`) here, before
    anything is built or compiled.

    Raises:
      ValueError: for an unknown key, a missing required key, an unknown mode or schedule, or
        a number out of its range (naming the key and the range).
    """
    given = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; allowed keys are {sorted(DEFAULTS)}.")
    missing = sorted(k for k, v in DEFAULTS.items() if v is REQUIRED and given.get(k) is None)
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}.")
    full = {**DEFAULTS, **given}
    _validate.check_choice("config.mode", full["mode"], MODES)
    _validate.check_choice("config.schedule", full["schedule"], SCHEDULES)
    full["writers"] = _writers.check(full["writers"])
    _extras.check_data(full["data_name"])
    _validate.check_choice("config.compute_dtype", full["compute_dtype"], _staged.COMPUTE_DTYPES)
    if not isinstance(full["batch_size"], int) or full["batch_size"] < 1:
        raise ValueError(f"config.batch_size must be a positive int; got {full['batch_size']!r}.")
    if not isinstance(full["total_steps"], int) or full["total_steps"] < 1:
        raise ValueError(f"config.total_steps must be a positive int; got {full['total_steps']!r}.")
    check_numbers(full)
    if full["eval_batch_size"] is None:
        full["eval_batch_size"] = full["batch_size"]
    if full["schedule_steps"] is not None and full["schedule"] not in HORIZON_SCHEDULES:
        raise ValueError(
            f"config.schedule_steps is the horizon of the cosine schedules "
            f"{list(HORIZON_SCHEDULES)}; config.schedule is {full['schedule']!r}: leave it None."
        )
    try:
        mesh = [(str(n), int(s)) for n, s in full["mesh"]]
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"config.mesh must be a list of (axis_name, size); got {full['mesh']!r}."
        ) from e
    full["mesh"] = mesh
    return ml_collections.ConfigDict(full)


#: the other top-level numeric keys: ``(kind, lower bound, upper bound or None, None allowed)``;
#: ``"int"`` keys take integers, ``"real"`` keys finite numbers, ``"positive"`` finite numbers
#: strictly above the bound
NUMBERS: dict[str, tuple[str, float, float | None, bool]] = {
    "seed": ("int", 0, 2**32 - 1, False),  # numpy's generators take no negative seed
    "eval_batch_size": ("int", 1, None, True),
    "schedule_steps": ("int", 1, None, True),
    "lr": ("positive", 0, None, False),
    "warmup_steps": ("int", 0, None, False),
    "grad_clip_norm": ("positive", 0, None, True),
    "weight_decay": ("real", 0, None, False),
    "log_every": ("int", 1, None, False),
    "eval_every": ("int", 0, None, False),
    "checkpoint_every": ("int", 0, None, False),
    "keep_checkpoints": ("int", 1, None, False),
    "max_nonfinite_in_a_row": ("int", 1, None, False),
    "link_probe_every": ("int", 0, None, False),
    "link_probe_bytes": ("int", 1024, None, False),
}


def check_numbers(full: dict[str, Any]) -> None:
    """Checks every key of :data:`NUMBERS` (and ``lr_decay_steps``' entries) in ``full``.

    Raises:
      ValueError: ``"config.KEY must be ... ; got VALUE."`` for the first key out of range.
    """
    for key, (kind, lo, hi, optional) in NUMBERS.items():
        name, value = f"config.{key}", full[key]
        if kind == "int":
            _validate.check_int(name, value, int(lo), hi, optional=optional)
        elif kind == "positive":
            _validate.check_number(name, value, gt=lo, finite=True, optional=optional)
        else:
            _validate.check_number(name, value, ge=lo, finite=True, optional=optional)
    steps = full["lr_decay_steps"]
    if not isinstance(steps, (list, tuple)):
        raise ValueError(f"config.lr_decay_steps must be a list of steps; got {steps!r}.")
    for i, step in enumerate(steps):
        _validate.check_int(f"config.lr_decay_steps[{i}]", step, 1)


def check_batch_divisible(config: ml_collections.ConfigDict, divisor: int, what: str) -> None:
    """``config.batch_size`` and ``config.eval_batch_size`` must split over ``divisor`` shards
    (``what`` names them: ``"the 8 devices"``, ``"4 workers"``).

    Raises:
      ValueError: naming the key, its value and the divisor.
    """
    for key in ("batch_size", "eval_batch_size"):
        if config[key] % divisor:
            raise ValueError(f"config.{key} ({config[key]}) is not divisible by {what}.")


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The part of the config that identifies an experiment (everything but run-length and
    logging keys), as plain JSON-able data.

    A cosine schedule's horizon is recorded as ``schedule_steps`` (resolved: ``total_steps``
    unless given), so that another ``total_steps`` that would reshape every step's learning
    rate is refused by name; other schedules record no horizon and may run longer.
    """
    d = json.loads(config.to_json_best_effort())
    out = {
        k: v for k, v in sorted(d.items())
        if k not in RUN_ONLY_KEYS and not (k in LATER_KEYS and v == LATER_KEYS[k])
    }  # fmt: skip
    out.pop("schedule_steps", None)
    if config.schedule in HORIZON_SCHEDULES:
        out["schedule_steps"] = schedule_horizon(config)
    return dict(sorted(out.items()))


def schedule_horizon(config: ml_collections.ConfigDict) -> int:
    """The step a cosine schedule reaches its end value: ``schedule_steps``, else
    ``total_steps``."""
    given = config.get("schedule_steps")
    return int(config.total_steps if given is None else given)


def fingerprint_hash(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def diff_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<missing>"), b.get(k, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule:
    """The schedule named by ``config.schedule`` with peak ``config.lr``.

    ``constant``; ``cosine`` (to 0 at step :func:`schedule_horizon`: ``schedule_steps``, by
    default ``total_steps``; 0 after it); ``warmup_cosine`` (linear warm-up for
    ``warmup_steps``, then cosine to the same horizon); ``step`` (divided by 10 at each of
    ``lr_decay_steps``).
    """
    lr, total = float(config.lr), schedule_horizon(config)
    if config.schedule == "constant":
        return optax.constant_schedule(lr)
    if config.schedule == "cosine":
        return optax.cosine_decay_schedule(lr, total)
    if config.schedule == "warmup_cosine":
        warm = int(config.warmup_steps)
        return optax.warmup_cosine_decay_schedule(0.0, lr, max(warm, 1), max(total, warm + 1))
    boundaries = {int(s): 0.1 for s in config.lr_decay_steps}
    return optax.piecewise_constant_schedule(lr, boundaries)


def optimizer(
    config: ml_collections.ConfigDict, schedule=None, *, clip: bool = True
) -> optax.GradientTransformation:
    """``optax.<optax_name>(learning_rate, **optax)``, with optional clipping and weight decay
    (``clip=False``: without ``grad_clip_norm``'s clipping, which the caller applies itself).

    Raises:
      ValueError: for an optimizer name that ``optax`` does not have, or bad keyword arguments.
    """
    name = config.optax_name
    factory = getattr(optax, name, None)
    if factory is None or not callable(factory):
        raise ValueError(
            f"unknown optimizer optax.{name}; use an optax optimizer name (sgd, adam, adamw, ...)."
        )
    schedule = learning_rate(config) if schedule is None else schedule
    try:
        opt = factory(learning_rate=schedule, **dict(config.optax))
    except TypeError as e:
        raise ValueError(f"config.optax does not fit optax.{name}: {e}") from e
    parts = []
    if config.grad_clip_norm and clip:
        parts.append(optax.clip_by_global_norm(float(config.grad_clip_norm)))
    if config.weight_decay and name not in ("adamw", "lamb", "lion"):
        parts.append(optax.add_decayed_weights(float(config.weight_decay)))
    return optax.chain(*parts, opt) if parts else opt


def check_sub_config(section: str, given: Any, allowed: dict[str, Any]) -> dict[str, Any]:
    """Checks the keys of a mode's sub-config (``config.pipeline`` ...) and fills defaults."""
    given = dict(given.to_dict() if hasattr(given, "to_dict") else given or {})
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in config.{section}; allowed are {sorted(allowed)}."
        )
    return {**allowed, **given}


def interval_steps(section: str, sub: dict[str, Any], steps_per_epoch: int) -> int:
    """A detector's interval in steps from ``sub["interval_epochs"]`` or ``sub["interval_steps"]``
    (one of the two; neither: one epoch), e.g. ``section="config.data_parallel"``.

    Raises:
      ValueError: naming the section if both are given or the one given is not a positive int.
    """
    epochs, steps = sub.get("interval_epochs"), sub.get("interval_steps")
    if epochs is not None and steps is not None:
        raise ValueError(
            f"{section}: give interval_epochs or interval_steps, not both; got "
            f"interval_epochs={epochs!r}, interval_steps={steps!r}."
        )
    if steps is not None:
        return _validate.check_int(f"{section}.interval_steps", steps, 1)
    epochs = 1 if epochs is None else epochs  # a whole number of epochs, never rounded
    return _validate.check_int(f"{section}.interval_epochs", epochs, 1) * steps_per_epoch


CODECS = ("identity", "cast", "quantize", "sign", "top_k", "rand_k", "power_sgd")
FEEDBACKS = (None, "ef", "ef21", "aq_sgd")


def build_codec(spec: Any):
    """A codec from ``{"name": ..., **kwargs}`` (or a bare name), e.g.
    ``{"name": "top_k", "fraction": 0.1, "per_sample": True}``.

    Raises:
      ValueError: naming an unknown codec or a keyword the codec does not take.
    """
    from jaxcomp import compressors

    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", None)
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; allowed codecs are {list(CODECS)}.")
    try:
        return getattr(compressors, name)(**spec)
    except TypeError as e:
        raise ValueError(f"bad arguments for codec {name!r}: {e}") from e


def build_channel(spec: Any, num_samples: int | None = None):
    """A channel from ``{"name": codec, "feedback": None | "ef" | "ef21" | "aq_sgd",
    "per_sample": bool, **codec kwargs}``; ``num_samples`` sizes per-sample buffers."""
    from jaxcomp import feedback

    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    kind = spec.pop("feedback", None)
    per_sample_buffers = spec.pop("per_sample_buffers", False)
    if kind not in FEEDBACKS:
        raise ValueError(f"unknown feedback {kind!r}; allowed are {list(FEEDBACKS)}.")
    codec = build_codec(spec)
    if kind is None:
        return feedback.plain(codec)
    if kind == "aq_sgd":
        if num_samples is None:
            raise ValueError("aq_sgd needs the number of training samples.")
        return feedback.aq_sgd(codec, num_samples)
    n = num_samples if per_sample_buffers else None
    return (feedback.error_feedback if kind == "ef" else feedback.ef21)(codec, num_samples=n)


def data_axes(mesh: Any, mode: str, others: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The data-parallel axes of a trainer's ``config.mesh``: ``()``, ``("data",)``, or a
    hierarchical ``(slow, fast)`` pair.

    The mesh's axes other than ``others`` (the pipeline's ``stage``), in mesh order: none, one
    named ``data``, or two of any names, the first the slow one (:func:`jaxcomp.comm.make_mesh`
    puts the first axis across hosts, so ``[("hosts", 2), ("local", 4), ...]`` reads slow,
    fast). ``ValueError`` naming the mesh otherwise.
    """
    axes = tuple(a for a in mesh.axis_names if a not in others)
    if len(axes) == 2 or axes in ((), ("data",)):
        return axes
    extra = f" besides {list(others)}" if others else ""
    raise ValueError(
        f"{mode} mode takes one data axis named 'data' or two data axes (slow, fast){extra}, "
        f"e.g. config.mesh = [('slow', 2), ('fast', 4)]; got mesh {dict(mesh.shape)}."
    )
