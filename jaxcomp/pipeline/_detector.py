r"""Accordion's detector for adaptive pipeline links: its settings, its state, and its update.

The senders of adaptive directions sum the squared norms they send into their channel state
(:func:`jaxcomp.pipeline._adaptive.track`); at the end of a step the driver reads those sums out
of the packed link states (:func:`accumulators`, :func:`collect_local` /
:func:`collect_stacked`, zeroed at an interval end) and :func:`update` decides the next modes
with :func:`jaxcomp._critical.critical_regime`. See :mod:`jaxcomp.pipeline._adaptive` for the
math.

References:
  Agarwal et al., `Accordion: Adaptive Gradient Communication via Critical Learning Regime
  Identification <https://arxiv.org/abs/2010.16248>`_, MLSys 2021.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _critical
from jaxcomp import _validate
from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _link_state

LOW_COMPRESSION = _critical.LOW_COMPRESSION  #: critical regime: the boundary's ``low`` link
HIGH_COMPRESSION = _critical.HIGH_COMPRESSION  #: otherwise: its ``high`` link
STATISTICS = _critical.STATISTICS


class Detector(NamedTuple):
    """Accordion's detector settings for a pipeline's adaptive links.

    Attributes:
      interval_steps: steps per interval (the reference's epoch); a Python int >= 1.
      check_every: ``T``, intervals between checks (10 in the reference's CNN runs).
      eta: the threshold on the relative norm change (0.5).
      learning_rate: ``None``, a number, or a schedule ``step -> lr``: a decrease between two
        steps switches every adaptive direction to low compression (piecewise-constant
        schedules; a smooth decay triggers at every step).
      statistic: with data replicas, ``"worker0"`` (replica 0's norms decide, the reference's
        rank 0) or ``"mean"`` (the mean of the replicas' norms).
    """

    interval_steps: int
    check_every: int = 10
    eta: float = 0.5
    learning_rate: Any = None
    statistic: str = "worker0"


class DetectorState(NamedTuple):
    """The detector's state (replicated), carried in ``LinkStates.adaptive``.

    Attributes:
      count: ``int32[]``, training steps taken; interval ``e = count // interval_steps``.
      mode: ``int32[S - 1, 2]``, per boundary and direction (forward, backward), the mode of
        the *next* step: :data:`LOW_COMPRESSION` or :data:`HIGH_COMPRESSION` (always low for a
        direction that is not adaptive).
      prev_norm: ``float32[S - 1, 2]``, the statistic at the last check.
      norm: ``float32[S - 1, 2]``, the statistic of the last completed interval.
    """

    count: jax.Array
    mode: jax.Array
    prev_norm: jax.Array
    norm: jax.Array


def check_detector(detector: Any) -> Detector:
    if not isinstance(detector, Detector):
        raise TypeError(
            "PipelineConfig.detector must be a pipeline.Detector(interval_steps, ...) when a "
            f"link is adaptive; got {type(detector).__name__}."
        )
    _validate.check_int("detector.interval_steps", detector.interval_steps, 1)
    _validate.check_int("detector.check_every", detector.check_every, 1)
    eta = detector.eta
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta > 0:
        raise ValueError(f"detector.eta must be a number > 0; got {eta!r}.")
    lr = detector.learning_rate
    number = isinstance(lr, (int, float)) and not isinstance(lr, bool)
    if not (lr is None or callable(lr) or number):
        raise ValueError(
            f"detector.learning_rate must be None, a number or a schedule; got {lr!r}."
        )
    _validate.check_choice("detector.statistic", detector.statistic, STATISTICS)
    return detector


def init_state(num_boundaries: int) -> DetectorState:
    """The detector's initial state: every direction in low compression (the first interval
    is critical, as in the reference)."""
    zeros = jnp.zeros((num_boundaries, 2), jnp.float32)
    return DetectorState(
        jnp.zeros((), jnp.int32), jnp.zeros((num_boundaries, 2), jnp.int32), zeros, zeros
    )


class Accumulators(NamedTuple):
    """Where each device's ``norm_sq`` leaves are: per direction, per device, the offset in
    buffer ``buffer`` (``-1``: the device sends no adaptive direction that way)."""

    buffer: str
    offsets: tuple[tuple[int, ...], tuple[int, ...]]


def accumulators(layout: _link_state.StateLayout, adaptive: Any) -> Accumulators:
    """The :class:`Accumulators` of ``layout`` (the forward sender of boundary ``d`` and the
    backward sender of ``d - 1`` live on device ``d``; a tracked end's first leaf is
    ``norm_sq``)."""
    num = layout.num_stages
    offsets, names = [], set()
    for d, role in enumerate(("forward_send", "backward_send")):
        row = []
        for dev in range(num):
            b = _link_state.owned_boundary(role, dev, num)
            if b is None or not adaptive.mask[b][d]:
                row.append(-1)
                continue
            first, _ = layout.roles[dev][_link_state.ROLES.index(role)]
            place = layout.places[dev][first]
            assert place.shape == () and place.dtype == "float32" and not place.rows, place
            names.add(place.buffer)
            row.append(place.offset)
        offsets.append(tuple(row))
    (buffer,) = names
    return Accumulators(buffer, tuple(offsets))


def collect_local(acc: Accumulators, states: dict, end: jax.Array):
    """Inside ``shard_map``: this device's accumulators as a ``[S - 1, 2]`` statistic (summed
    over ``stage``, replicated over ``data``), and ``states`` with them zeroed at an interval
    end."""
    stage = lax.axis_index(_mesh.STAGE)
    buf = states[acc.buffer]
    num = len(acc.offsets[0])
    stats = jnp.zeros((num - 1, 2), jnp.float32)
    for d in range(2):
        table = np.asarray(acc.offsets[d])
        off = jnp.asarray(np.maximum(table, 0))[stage]
        ok = jnp.asarray(table >= 0)[stage]
        value = lax.dynamic_index_in_dim(buf, off, keepdims=False)
        here = jnp.logical_and(jnp.arange(num - 1) == stage - d, ok)
        stats = stats.at[:, d].set(jnp.where(here, value, 0.0))
        new = jnp.where(jnp.logical_and(ok, end), jnp.zeros_like(value), value)
        buf = lax.dynamic_update_index_in_dim(buf, new, off, 0)
    stats = lax.psum(stats, _mesh.STAGE)
    return stats, {**states, acc.buffer: buf}


def collect_stacked(acc: Accumulators, states: dict, end: jax.Array):
    """:func:`collect_local` for stacked ``{name: [S, ...]}`` buffers (the simulation)."""
    buf = states[acc.buffer]
    num = len(acc.offsets[0])
    stats = jnp.zeros((num - 1, 2), jnp.float32)
    for d in range(2):
        for dev, off in enumerate(acc.offsets[d]):
            if off < 0:
                continue
            stats = stats.at[dev - d, d].set(buf[dev, off])
            buf = buf.at[dev, off].set(jnp.where(end, 0.0, buf[dev, off]))
    return stats, {**states, acc.buffer: buf}


def replicate(
    stats: jax.Array, detector: Detector, replicas: int, data: Any = _mesh.DATA
) -> jax.Array:
    """The statistic every replica decides with (one tiny all-reduce over ``data``, the
    replicas' axis or axes)."""
    if replicas < 2:
        return stats
    return _critical.replicated_norms(stats, data, detector.statistic)


def interval_end(detector: Detector, state: DetectorState) -> jax.Array:
    """Whether the step about to run (number ``state.count``) ends an interval."""
    return (state.count + 1) % detector.interval_steps == 0


def _lr(schedule: Callable | None, count: jax.Array) -> jax.Array | None:
    if schedule is None or not callable(schedule):
        return None  # a constant learning rate never drops
    return jnp.asarray(schedule(count), jnp.float32)


def update(adaptive: Any, state: DetectorState, stats: jax.Array) -> DetectorState:
    """The detector after one step whose accumulated squared norms are ``stats``.

    At the end of interval ``e`` (``stats`` then holds its sums), when ``e % T == 0``, each
    adaptive direction takes the mode :func:`jaxcomp._critical.critical_regime` decides; a
    learning-rate drop at the next step switches every adaptive direction to low.
    """
    det = adaptive.detector
    count = state.count
    interval = count // det.interval_steps
    end = interval_end(det, state)
    check = jnp.logical_and(end, interval % det.check_every == 0)
    norm = jnp.sqrt(stats)
    critical = _critical.critical_regime(state.prev_norm, norm, det.eta, interval == 0)
    decided = jnp.where(critical, LOW_COMPRESSION, HIGH_COMPRESSION).astype(jnp.int32)
    mode = jnp.where(check, decided, state.mode)
    now, nxt = _lr(det.learning_rate, count), _lr(det.learning_rate, count + 1)
    if now is not None:
        mode = jnp.where(nxt < now, LOW_COMPRESSION, mode)
    mask = jnp.asarray(np.asarray(adaptive.mask, bool))
    mode = jnp.where(mask, mode, LOW_COMPRESSION).astype(jnp.int32)
    return DetectorState(
        count + 1,
        mode,
        jnp.where(check, norm, state.prev_norm),
        jnp.where(end, norm, state.norm),
    )


def program_statistic(
    adaptive: Any, layout, states: dict, state: DetectorState, replicas: int, data=_mesh.DATA
):
    """Inside the pipeline program: ``(statistic, states)`` of :func:`collect_local`, made
    identical over ``data`` (:func:`replicate`); ``(None, states)`` without adaptive links."""
    if adaptive is None:
        return None, states
    acc = accumulators(layout, adaptive)
    stats, states = collect_local(acc, states, interval_end(adaptive.detector, state))
    return replicate(stats, adaptive.detector, replicas, data), states


def stacked_statistic(adaptive: Any, layout, states: dict, state: DetectorState):
    """:func:`program_statistic` for the simulation's stacked buffers."""
    if adaptive is None:
        return None, states
    acc = accumulators(layout, adaptive)
    return collect_stacked(acc, states, interval_end(adaptive.detector, state))
