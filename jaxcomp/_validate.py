"""Construction-time checks shared by every layer of jaxcomp.

Each check raises ``ValueError`` naming the parameter, the allowed values and what it got, so
a bad argument is reported where it is given, before anything is traced. The module imports
only JAX and NumPy: every package (codecs to trainer) may use it.

* numbers: :func:`check_int` (integer range), :func:`check_number` (real range, finite,
  strict or not), :func:`check_fraction` (``(0, 1]``), :func:`check_choice`,
  :func:`check_bool`;
* static Python values vs traced arrays: :func:`static_int`, :func:`static_number` (an
  array, e.g. from ``optax.inject_hyperparams``, gets a message naming ``static_args``);
* JAX structure: :func:`check_axis_name`, :func:`check_tree` (an updates tree against the
  tree a state was built for), :func:`check_like` (one array's shape and dtype),
  :func:`check_state_leaves` (a state against the one ``init`` would build), :func:`describe`.

Example:
  >>> from jaxcomp import _validate
  >>> _validate.check_int("rank", 4, 1)
  4
  >>> _validate.check_int("rank", 0, 1)
  Traceback (most recent call last):
  ...
  ValueError: rank must be an integer >= 1; got 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------------------------
# Numbers and choices


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array (JAX, NumPy or a tracer), not a Python or NumPy scalar."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic)) and not isinstance(
        value, (np.integer, np.floating)
    )


def is_int(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy integer (``bool`` is not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy real number (``bool`` is not)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_concrete_scalar(value: Any) -> bool:
    if isinstance(value, jax.core.Tracer) or not isinstance(value, (np.ndarray, jax.Array)):
        return False
    return value.ndim == 0 and np.dtype(value.dtype).kind in "iuf"


def _range_text(lo: Any, hi: Any) -> str:
    upper = "" if hi is None else f" and <= {hi}"
    return f">= {lo}{upper}" if lo is not None else (f"<= {hi}" if hi is not None else "")


def check_int(
    name: str, value: Any, lo: int | None = None, hi: int | None = None, *, optional: bool = False
) -> int | None:
    """``value`` as a Python int in ``[lo, hi]`` (``None`` allowed with ``optional``).

    Raises:
      ValueError: ``"{name} must be [None or ]an integer >= lo [and <= hi]; got {value!r}."``
        for a float, a bool, a string or an integer out of range.
    """
    if optional and value is None:
        return None
    ok = is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        none = "None or " if optional else ""
        bounds = _range_text(lo, hi)
        kind = f"an integer {bounds}" if bounds else "an integer"
        raise ValueError(f"{name} must be {none}{kind}; got {value!r}.")
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = False,
    optional: bool = False,
) -> float | None:
    """``value`` as a Python float within the given bounds (never NaN, never a bool).

    Args:
      name: the parameter's name, for the message.
      value: the value given.
      ge, gt, le, lt: inclusive/exclusive lower and upper bounds (``None``: unbounded).
      finite: reject ``±inf``.
      optional: accept ``None`` (returned as is).

    Returns:
      ``float(value)`` (or ``None``).

    Raises:
      ValueError: ``"{name} must be [None or ]a [finite ]number > 0; got {value!r}."``.
    """
    if optional and value is None:
        return None
    if _is_concrete_scalar(value):  # a 0-d NumPy or (untraced) JAX array of a real dtype
        value = value.item()
    parts = [f">= {ge}" if ge is not None else "", f"> {gt}" if gt is not None else ""]
    parts += [f"<= {le}" if le is not None else "", f"< {lt}" if lt is not None else ""]
    bounds = " and ".join(p for p in parts if p)
    ok = is_number(value) and not math.isnan(value)  # NaN fails every comparison: reject it
    if ok:
        v = float(value)
        ok = (
            (ge is None or v >= ge)
            and (gt is None or v > gt)
            and (le is None or v <= le)
            and (lt is None or v < lt)
            and (not finite or math.isfinite(v))
        )
    if not ok:
        none = "None or " if optional else ""
        kind = "a finite number" if finite else "a number"
        text = f"{name} must be {none}{kind}{' ' + bounds if bounds else ''}; got {value!r}."
        raise ValueError(text)
    return float(value)


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float in ``(0, 1]``; ``ValueError`` naming ``name`` otherwise."""
    if not (is_number(value) and 0.0 < float(value) <= 1.0):
        raise ValueError(f"{name} must be a fraction in (0, 1]; got {value!r}.")
    return float(value)


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``; ``ValueError`` listing them otherwise."""
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value against a set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {tuple(allowed)}; got {value!r}.")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a Python or NumPy bool (not ``0``/``1``, not a string)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool; got {value!r}.")
    return bool(value)


# ----------------------------------------------------------------------------------------------
# Static Python values (shapes, schedules, keys) vs traced arrays


def static_hint(name: str) -> str:
    """Why ``name`` must be a Python value, and how to keep it one under ``inject_hyperparams``."""
    return (
        f"{name} is static (it fixes the trace: shapes, schedules, keys), so it must be a Python "
        f"number, not an array. Under optax.inject_hyperparams pass it in static_args "
        f"(e.g. static_args=({name!r},))."
    )


def static_int(name: str, value: Any, lo: int) -> int:
    """``value`` as a Python int ``>= lo``; a clear ``ValueError`` for arrays, floats, bools."""
    if is_array(value):
        raise ValueError(
            f"{name} must be a Python int >= {lo}; got {value!r}. " + static_hint(name)
        )
    return check_int(name, value, lo)


def static_number(name: str, value: Any, lo: float) -> float:
    """``value`` as a Python float ``>= lo``; a clear ``ValueError`` for arrays and the rest."""
    if is_array(value):
        raise ValueError(
            f"{name} must be a Python number >= {lo}; got {value!r}. " + static_hint(name)
        )
    return check_number(name, value, ge=lo)


# ----------------------------------------------------------------------------------------------
# JAX structure: axis names, trees, shapes and dtypes


def check_axis_name(axis_name: Any, name: str = "axis_name") -> str | None:
    """``axis_name`` if it is a mesh axis name (``str``) or ``None``."""
    if axis_name is not None and not isinstance(axis_name, str):
        raise ValueError(f"{name} must be a mesh axis name (str) or None; got {axis_name!r}.")
    return axis_name


def describe(x: Any) -> str:
    """``float32[8,6]``-style description of an array or ``ShapeDtypeStruct``."""
    return f"{jnp.dtype(x.dtype).name}[{','.join(str(d) for d in x.shape)}]"


def check_tree(updates: Any, leaves: Any, who: str) -> None:
    """Raises ``ValueError`` unless ``updates`` has the tree ``leaves`` was built for.

    ``leaves`` holds one node (e.g. one state) per leaf of the tree: a prefix of ``updates``.
    """
    got = jax.tree.structure(updates)
    try:
        got.flatten_up_to(leaves)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{who}: the updates tree does not match the tree the state was initialised with.\n"
            f"  updates: {got}\n  {err}"
        ) from None


def check_like(x: Any, like: Any, who: str) -> None:
    """Raises ``ValueError`` naming both when ``x`` is not shaped and typed as ``like``."""
    if tuple(x.shape) != tuple(like.shape) or jnp.dtype(x.dtype) != jnp.dtype(like.dtype):
        raise ValueError(
            f"{who}: the state was built for {describe(like)}; got {describe(x)}. A state "
            "accepts only the shape and dtype it was initialised with."
        )


def check_state_leaves(state: Any, expected: Any, name: str, like: Any, who: str) -> None:
    """Raises ``ValueError`` naming the parameter when ``state`` is not what ``init`` built
    for an array like ``like`` (``expected``, e.g. from ``jax.eval_shape``): a tree, shape or
    dtype other than init's."""
    same = jax.tree.structure(state) == jax.tree.structure(expected) and all(
        tuple(a.shape) == tuple(b.shape) and jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected))
    )
    if not same:
        raise ValueError(
            f"{who}: the state of parameter {name} was not built for "
            f"{describe(like)} (a shape or dtype other than init's?).\n"
            f"  state:    {jax.tree.map(describe, state)}\n"
            f"  expected: {jax.tree.map(describe, expected)}"
        )
