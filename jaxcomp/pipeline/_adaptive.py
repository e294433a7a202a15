r"""Accordion on pipeline links: each boundary switches between a low and a high compression.

A boundary given as an :class:`AdaptiveLink` has two ordinary links, ``low`` (for critical
regimes, e.g. 8-bit activations) and ``high`` (e.g. 4-bit), and a mode per direction: its
forward channel is chosen by the norms of the activations it carries, its backward channel by
the norms of the activation-gradients. The detector is Accordion's (Agarwal et al., 2021),
:mod:`jaxcomp._regime`: over an interval of ``interval_steps`` training
steps the sender of each adaptive direction accumulates

.. math::
  n_{b,d}(e)^2 = \sum_{t \in e}\ \sum_{m=0}^{M-1} \|x^{(t)}_{b,d,m}\|_2^2

(the 2-norm of everything it sent over the interval, from real microbatches only: the sum
lives in the sending channel's state, which bubble ticks never touch), and every ``T``-th
interval end (``interval % T == 0``) decides

.. math::
  \text{mode}_{b,d} = \begin{cases} \text{low} & e = 0 \ \lor\ |n(e-T) - n(e)| / n(e-T)
  \ge \eta \\ \text{high} & \text{otherwise} \end{cases}

with a learning-rate decrease switching every adaptive direction to low until the next check,
as :func:`jaxcomp.transforms.accordion` does for gradients (the same function decides; the
detector's settings, state and update are at the end of this module).

**One program per mode combination.** The modes are host-visible state
(:class:`DetectorState`, in ``LinkStates.adaptive``), changed only by a step's detector update.
Each step runs the ordinary pipeline program of the links the modes select, compiled once per
combination that is actually used, so a step's sends are exactly the selected codecs' payloads
(no ``lax.switch`` holding both codecs' collectives) and its HLO bytes are that program's
theoretical bytes. The only extra collective is one all-reduce of ``2 (S - 1)`` float32
statistics per step (and, with data replicas, one more over ``data``: replica 0's statistic
decides for all, as the reference's rank 0).

**State across a switch.** The low and high channels of a direction share one state: they must
keep the same state structure (e.g. both ``error_feedback`` of stateless codecs, both
``aq_sgd``, both plain), otherwise construction raises. The error-feedback residual, EF21
estimate or AQ-SGD caches therefore carry over a switch: the first high-compression send
compensates what the low codec dropped, as Accordion keeps its error memory across switches
(the sender and receiver mirrors stay identical since both ends decode the same payloads).

References:
  Agarwal et al., `Accordion: Adaptive Gradient Communication via Critical Learning Regime
  Identification <https://arxiv.org/abs/2010.16248>`_, MLSys 2021.
  Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
  <https://arxiv.org/abs/2401.07788>`_, 2024 (the right level depends on the phase of training).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _regime
from jaxcomp._regime import HIGH_COMPRESSION
from jaxcomp._regime import LOW_COMPRESSION
from jaxcomp._regime import Detector
from jaxcomp.comm import _mesh
from jaxcomp.feedback import _channel
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state

DIRECTIONS = ("forward", "backward")


class AdaptiveLink(NamedTuple):
    """A boundary that switches between two links by Accordion's detector.

    Attributes:
      low: the :class:`Link` of critical regimes (low compression, e.g. 8-bit).
      high: the :class:`Link` otherwise (high compression, e.g. 4-bit).
    """

    low: _config.Link
    high: _config.Link

    @property
    def directions(self) -> tuple[bool, bool]:
        """Whether the forward and the backward direction adapt (their channels differ; in
        ``"shared_mask"`` mode the backward never does)."""
        fwd = self.low.forward is not self.high.forward
        bwd = self.low.mode == "independent" and self.low.backward is not self.high.backward
        return fwd, bwd


class TrackedSend(NamedTuple):
    """Sender state of an adaptive direction: the interval's sum of squared norms sent, and the
    wrapped channel's own sender state."""

    norm_sq: jax.Array
    state: Any


class Adaptive(NamedTuple):
    """A pipeline's adaptive boundaries, resolved (static and hashable).

    Attributes:
      low: per boundary, the link of low compression (tracked where adaptive).
      high: per boundary, the link of high compression (``low`` itself where fixed).
      mask: per boundary, ``(forward adaptive, backward adaptive)``.
      detector: the :class:`Detector`.
    """

    low: tuple[_config.Link, ...]
    high: tuple[_config.Link, ...]
    mask: tuple[tuple[bool, bool], ...]
    detector: Detector

    def links(self, modes: Any) -> tuple[_config.Link, ...]:
        """The links of a mode combination (``[S - 1][2]`` ints)."""
        out = []
        for b, (lo, hi) in enumerate(zip(self.low, self.high)):
            fwd = (hi if int(modes[b][0]) == HIGH_COMPRESSION else lo).forward
            bwd = (hi if int(modes[b][1]) == HIGH_COMPRESSION else lo).backward
            out.append(_config.Link(fwd, bwd, lo.mode))
        return tuple(out)

    def all_low(self) -> tuple[tuple[int, int], ...]:
        return tuple((LOW_COMPRESSION, LOW_COMPRESSION) for _ in self.low)


def adaptive_link(low: _config.Link, high: _config.Link) -> AdaptiveLink:
    """A boundary that compresses less in critical regimes (Accordion on a pipeline link).

    Each direction with different channels in ``low`` and ``high`` is adaptive: the forward
    one is chosen by the norms of the activations, the backward one by the norms of the
    activation-gradients (see :mod:`jaxcomp.pipeline._adaptive`). Give the pipeline a
    :class:`Detector` in ``PipelineConfig.detector``.

    Args:
      low: :class:`Link` of critical regimes (e.g. ``link(quantize(8), quantize(8))``).
      high: :class:`Link` otherwise (e.g. ``link(quantize(4), quantize(8))``: only the
        forward adapts). Both must have the same backward mode; in ``"shared_mask"`` mode only
        the forward adapts (the backward follows its mask).

    Returns:
      An :class:`AdaptiveLink`, usable wherever a :class:`Link` is (``PipelineConfig.links``).

    Example:
      >>> from jaxcomp import compressors, pipeline
      >>> lk = pipeline.adaptive_link(
      ...     pipeline.link(compressors.quantize(8), compressors.quantize(8)),
      ...     pipeline.link(compressors.quantize(4), compressors.quantize(8)),
      ... )
      >>> lk.high.forward.name
      'quantize(4, tensor)'
    """
    for name, lk in (("low", low), ("high", high)):
        if not isinstance(lk, _config.Link):
            raise TypeError(
                f"adaptive_link's {name} must be a pipeline.Link (pipeline.link(...)); got "
                f"{type(lk).__name__}."
            )
    if low.mode != high.mode:
        raise ValueError(
            f"adaptive_link's low and high links must have the same backward mode; got "
            f"{low.mode!r} and {high.mode!r}."
        )
    return AdaptiveLink(low, high)


def track(channel: _channel.Channel) -> _channel.Channel:
    """``channel`` whose sender also sums the squared 2-norm of what it sends (compressed or
    dense) into its state (:class:`TrackedSend`); payloads and the receiver are unchanged."""

    def init(x):
        send, recv = channel.init(x)
        return TrackedSend(jnp.zeros((), jnp.float32), send), recv

    def add(st, x):
        x32 = jnp.asarray(x).astype(jnp.float32)
        return st.norm_sq + jnp.sum(x32 * x32)

    def send(x, st, key=None, ids=None):
        payload, inner = channel.send(x, st.state, key, ids)
        return payload, TrackedSend(add(st, x), inner)

    def dense_send(x, st, ids=None):
        return TrackedSend(add(st, x), channel.dense_send(x, st.state, ids))

    return channel._replace(init=init, send=send, dense_send=dense_send)


def _states_struct(channel, shape):
    both = jax.eval_shape(channel.init, jax.ShapeDtypeStruct(shape.shape, shape.dtype))
    return jax.tree.map(lambda a: (a.shape, str(a.dtype)), both)


def resolve(config: _config.PipelineConfig, num_stages: int):
    """Splits ``config.links`` into plain links and the adaptive boundaries.

    Returns:
      ``(links, adaptive)``: one :class:`Link` per boundary (the low-compression ones, tracked
      where adaptive) and an :class:`Adaptive`, or ``None`` when no link is adaptive.
    """
    links = config.links
    if isinstance(links, (_config.Link, AdaptiveLink)):
        links = (links,) * (num_stages - 1)
    links = tuple(links)
    if not any(isinstance(lk, AdaptiveLink) for lk in links):
        if config.detector is not None:
            raise ValueError(
                "PipelineConfig.detector is set but no link is adaptive; use "
                "pipeline.adaptive_link(low, high) for the boundaries that should switch."
            )
        return _config.resolve_links(config, num_stages), None
    detector = check_detector(config.detector)
    low = [lk.low if isinstance(lk, AdaptiveLink) else lk for lk in links]
    _config.resolve_links(config._replace(links=tuple(low)), num_stages)  # the usual checks
    lows, highs, mask = [], [], []
    for lk in links:
        if not isinstance(lk, AdaptiveLink):
            lows.append(lk)
            highs.append(lk)
            mask.append((False, False))
            continue
        fwd, bwd = lk.directions
        lo_f = track(lk.low.forward) if fwd else lk.low.forward
        hi_f = track(lk.high.forward) if fwd else lo_f
        lo_b = track(lk.low.backward) if bwd else lk.low.backward
        hi_b = track(lk.high.backward) if bwd else lo_b
        lows.append(_config.Link(lo_f, lo_b, lk.low.mode))
        highs.append(_config.Link(hi_f, hi_b, lk.low.mode))
        mask.append((fwd, bwd))
    if not any(f or b for f, b in mask):
        raise ValueError(
            "every adaptive_link has the same channels in low and high: nothing would switch."
        )
    return tuple(lows), Adaptive(tuple(lows), tuple(highs), tuple(mask), detector)


def check_shared_state(adaptive: Adaptive, shapes) -> None:
    """Raises ``ValueError`` naming the boundary and direction whose low and high channels keep
    different state (they share one state across a switch)."""
    for b, (lo, hi, shape) in enumerate(zip(adaptive.low, adaptive.high, shapes)):
        for d, direction in enumerate(DIRECTIONS):
            if not adaptive.mask[b][d]:
                continue
            a, c = getattr(lo, direction), getattr(hi, direction)
            sa, sc = _states_struct(a, shape), _states_struct(c, shape)
            if sa != sc or a.per_sample != c.per_sample or a.sample_fields != c.sample_fields:
                raise ValueError(
                    f"links[{b}]: the low ({a.name}) and high ({c.name}) {direction} channels "
                    f"keep different state ({sa} vs {sc}); an adaptive link keeps one state "
                    "across a switch: use the same feedback around codecs with the same state "
                    "(e.g. error_feedback(quantize(8)) and error_feedback(quantize(4)))."
                )


def host_modes(state: DetectorState) -> tuple[tuple[int, int], ...]:
    """The modes of the next step as Python ints (reads the device: call it on the host)."""
    if isinstance(state.mode, jax.core.Tracer):
        raise ValueError(
            "the link modes choose the program, so they must be known on the host: under "
            "jax.jit pass modes=pipeline.link_modes(link_states) (read before the call) as a "
            "static argument."
        )
    m = np.asarray(jax.device_get(state.mode))
    return tuple((int(f), int(b)) for f, b in m)


def link_modes(link_states: Any) -> tuple[tuple[int, int], ...]:
    """The ``(forward, backward)`` mode of each boundary for the next step, read on the host.

    Pass them to a jitted step as the static ``modes=`` (the step checks that they are the
    state's; a mismatch gives a NaN loss and gradients and ``metrics["modes_mismatch"] == 1``).

    Args:
      link_states: the :class:`LinkStates` of a pipeline with adaptive links.

    Returns:
      ``S - 1`` pairs of :data:`LOW_COMPRESSION` (0) / :data:`HIGH_COMPRESSION` (1).
    """
    state = getattr(link_states, "adaptive", None)
    if state is None:
        raise ValueError("these link states have no adaptive links (no detector state).")
    return host_modes(state)


def check_modes(modes: Any, adaptive: Adaptive | None) -> tuple[tuple[int, int], ...] | None:
    """``modes`` as a hashable ``[S - 1][2]`` tuple of ints, checked."""
    if adaptive is None:
        if modes is not None:
            raise ValueError("modes= is only for pipelines with adaptive links.")
        return None
    try:
        out = tuple((int(f), int(b)) for f, b in modes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"modes must be [S - 1][2] ints (0 low, 1 high); got {modes!r}.") from e
    ok = len(out) == len(adaptive.low) and all(v in (0, 1) for p in out for v in p)
    if not ok:
        raise ValueError(
            f"modes must be {len(adaptive.low)} pairs (forward, backward) of 0 (low) or 1 "
            f"(high); got {modes!r}."
        )
    for b, (f, bw) in enumerate(out):
        for d, v in enumerate((f, bw)):
            if v and not adaptive.mask[b][d]:
                raise ValueError(
                    f"modes[{b}][{d}] is 1 but the {DIRECTIONS[d]} direction of boundary {b} "
                    "is not adaptive."
                )
    return out


# ----------------------------------------------------------------------------------------------
# The driver's hooks (each a no-op without adaptive links)


def combo(spec: Any, modes: Any) -> Any:
    """The driver ``spec`` whose links are those ``modes`` select (``spec`` itself without
    adaptive links); the driver caches its programs per combination."""
    if spec.adaptive is None:
        return spec
    return spec._replace(links=spec.adaptive.links(modes))


def combo_or_low(spec: Any, modes: Any) -> Any:
    """:func:`combo` for evaluation and byte counts, which have no detector state to read:
    ``modes`` checked, every boundary in low compression when ``None``."""
    if spec.adaptive is not None and modes is None:
        return combo(spec, spec.adaptive.all_low())
    return combo(spec, check_modes(modes, spec.adaptive))


def init_detector(adaptive: Adaptive | None, shapes, mesh) -> DetectorState | None:
    """The detector's initial state (replicated on ``mesh``), after checking that the low and
    high channels of every adaptive direction share one state layout."""
    if adaptive is None:
        return None
    check_shared_state(adaptive, shapes)
    init = jax.jit(initial_detector_state, static_argnums=0)
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        init = jax.jit(initial_detector_state, static_argnums=0, out_shardings=replicated)
    return init(len(adaptive.low))


def step_modes(adaptive: Adaptive | None, link_states: Any, modes: Any):
    """The checked mode combination of a step: ``modes`` as given, else read from the state."""
    detector_state = getattr(link_states, "adaptive", None)
    if adaptive is None:
        if detector_state is not None:
            raise ValueError(
                "link_states carry an adaptive-link detector state, but this pipeline has no "
                "adaptive links: initialise them with this pipeline's init."
            )
        return check_modes(modes, None)
    if detector_state is None:
        raise ValueError(
            "this pipeline has adaptive links: its link_states carry the detector's state "
            "(initialise them with this pipeline's init)."
        )
    if modes is None:
        modes = host_modes(detector_state)
    return check_modes(modes, adaptive)


def finish_step(adaptive: Adaptive | None, modes, old: Any, stats, loss, grads, metrics):
    """``(detector state, loss, grads, metrics)`` after a step: the detector's update, the modes
    in the metrics, and a poisoned step (NaN loss and gradients, ``modes_mismatch`` 1) when
    ``modes`` were not the state's (a jitted step given stale static modes)."""
    if adaptive is None:
        return None, loss, grads, metrics
    used = jnp.asarray(np.asarray(modes, np.int32))
    mismatch = jnp.any(old.mode != used)
    loss = jnp.where(mismatch, jnp.nan, loss)
    grads = jax.tree.map(lambda g: jnp.where(mismatch, jnp.nan, g), grads)
    metrics = {
        **metrics, "loss": loss, "link_modes": used, "modes_mismatch": mismatch.astype(jnp.int32)
    }  # fmt: skip
    return update_detector(adaptive, old, stats), loss, grads, metrics


# ----------------------------------------------------------------------------------------------
# Accordion's detector for the adaptive links: its settings, state, statistic and update.
#
# The senders of adaptive directions sum the squared norms they send into their channel state
# (:func:`track`); at the end of a step the driver reads those sums out of the packed link states
# (:func:`accumulators`, :func:`collect_local` / :func:`collect_stacked`, zeroed at an interval
# end) and :func:`update_detector` decides the next modes with
# :func:`jaxcomp._regime.decide` (the math: the module docstring).


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
    """``PipelineConfig.detector`` checked: a :class:`Detector` of Python values (it keys the
    compiled programs)."""
    if not isinstance(detector, Detector):
        raise TypeError(
            "PipelineConfig.detector must be a pipeline.Detector(interval_steps, ...) when a "
            f"link is adaptive; got {type(detector).__name__}."
        )
    return _regime.check_detector(detector, "detector.", static=True)


def initial_detector_state(num_boundaries: int) -> DetectorState:
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
    return _regime.replicated_norms(stats, data, detector.statistic)


def interval_end(detector: Detector, state: DetectorState) -> jax.Array:
    """Whether the step about to run (number ``state.count``) ends an interval."""
    return _regime.position(detector, state.count)[1]


def update_detector(adaptive: Any, state: DetectorState, stats: jax.Array) -> DetectorState:
    """The detector after one step whose accumulated squared norms are ``stats``.

    At the end of interval ``e`` (``stats`` then holds its sums) each adaptive direction takes
    the mode :func:`jaxcomp._regime.decide` gives (at a check, ``e % T == 0``); a learning-rate
    drop at the next step switches every adaptive direction to low.
    """
    det = adaptive.detector
    count = state.count
    interval, end, check = _regime.position(det, count)
    norm = jnp.sqrt(stats)
    mode, prev_norm = _regime.decide(det, interval, check, state.prev_norm, norm, state.mode)
    now = _regime.current_lr(det.learning_rate, count)
    if now is not None:  # the modes are the next step's: its learning rate against this one's
        nxt = _regime.current_lr(det.learning_rate, count + 1)
        mode = jnp.where(nxt < now, LOW_COMPRESSION, mode)
    mask = jnp.asarray(np.asarray(adaptive.mask, bool))
    mode = jnp.where(mask, mode, LOW_COMPRESSION).astype(jnp.int32)
    return DetectorState(count + 1, mode, prev_norm, jnp.where(end, norm, state.norm))


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
