"""Per-array plans and states of :func:`jaxcomp.comm.compressed_pmean`; the bytes they send.

:func:`init_reduce` chooses the path of one array once (see :mod:`jaxcomp.comm._reduce` for
the five paths), falling back to ``dense`` with a logged reason when the codec cannot handle
the shape, the array has fewer than ``min_ndim`` dimensions, or the payload is not
``min_compression_rate`` times smaller than the array, and records the choice in the *type*
of the state it returns, so the choice is saved with the state and the reduction needs no
static configuration.

State fields owned by one worker (error-feedback residuals, per-worker codec states) carry a
leading axis of size 1 and are marked varying over the axis: outside ``shard_map`` they stack to
``[W, ...]`` and are sharded over the data axis; the other fields are replicated.
"""

from __future__ import annotations

import logging
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp.comm import _local
from jaxcomp.compressors import _base

PATHS = ("auto", "dense", "psum", "all_gather", "two_phase", "low_rank")
_AUTO = {
    compressors.Reduction.SUM: "psum",
    compressors.Reduction.GATHER: "all_gather",
    compressors.Reduction.LOW_RANK: "low_rank",
}
_log = logging.getLogger(__name__)


class DenseReduce(NamedTuple):
    """State of an array averaged uncompressed with ``lax.pmean`` (there is none)."""


class PsumReduce(NamedTuple):
    """State of the ``psum`` path.

    Attributes:
      send: the channel's sender state, per worker (leaves ``[1, ...]``).
      recv: the channel's receiver state, replicated (EF21's estimate of the mean).
    """

    send: Any
    recv: Any


class GatherReduce(NamedTuple):
    """State of the ``all_gather`` path (fields as :class:`PsumReduce`)."""

    send: Any
    recv: Any


class TwoPhaseReduce(NamedTuple):
    """State of the ``two_phase`` path.

    Attributes:
      send: sender states of this worker's W chunks (leaves ``[1, W, ...]``).
      server: codec state of the chunk this worker reduces (leaves ``[1, ...]``).
      server_residual: ``[1, chunk]``: what re-compressing the reduced chunk dropped so far.
    """

    send: Any
    server: Any
    server_residual: jax.Array


class LowRankReduce(NamedTuple):
    """State of the PowerSGD ``low_rank`` path.

    Attributes:
      q: :class:`~jaxcomp.compressors.PowerSGDState`, replicated (the warm start).
      residual: ``[1, *shape]`` error-feedback memory ``M - P Qᵀ`` of this worker, or
        :class:`~jaxcomp.compressors.EmptyState` without error feedback.
    """

    q: compressors.PowerSGDState
    residual: Any


REDUCE_STATES = (DenseReduce, PsumReduce, GatherReduce, TwoPhaseReduce, LowRankReduce)


def is_reduce_state(node: Any) -> bool:
    """Whether ``node`` is one of the per-array states of this module (for ``is_leaf``)."""
    return isinstance(node, REDUCE_STATES)


# ----------------------------------------------------------------------------------------------
# Axis, worker-owned state and key helpers


def axis_size(axis_name: str | None) -> int:
    """Number of workers on ``axis_name`` inside ``shard_map`` (1 for ``None``).

    Raises:
      ValueError: if ``axis_name`` is not a manual axis of the enclosing ``shard_map``.
    """
    if axis_name is None:
        return 1
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a mesh axis name (str) or None; got {axis_name!r}.")
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual
    )
    if axis_name not in manual:
        where = f"the manual axes here are {manual}" if manual else "not inside shard_map"
        raise ValueError(
            f"axis_name {axis_name!r} is not a mesh axis of the enclosing shard_map ({where}). "
            f"Run this inside jax.shard_map over a mesh with an axis named {axis_name!r}, "
            "or pass the right axis_name."
        )
    return lax.axis_size(axis_name)


def per_worker(tree: Any, axis_name: str | None) -> Any:
    """Adds the leading worker axis of size 1 and marks the leaves varying over ``axis_name``."""
    tree = jax.tree.map(lambda leaf: leaf[None], tree)
    return tree if axis_name is None else _local.to_varying(tree, axis_name)


def local(tree: Any) -> Any:
    """Drops the leading worker axis added by :func:`per_worker`."""
    return jax.tree.map(lambda leaf: leaf[0], tree)


def worker_key(key: jax.Array | None, axis_name: str | None) -> jax.Array | None:
    """``key`` decorrelated per worker (``fold_in`` of the axis index)."""
    if key is None or axis_name is None:
        return key
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def chunk_like(like, num_workers: int) -> jax.ShapeDtypeStruct:
    """The flat chunk of ``like`` that one worker reduces on the ``two_phase`` path."""
    return jax.ShapeDtypeStruct((-(-math.prod(like.shape) // num_workers),), like.dtype)


# ----------------------------------------------------------------------------------------------
# Planning


def check_path(codec: compressors.Codec, path: str) -> None:
    """Raises ``ValueError`` if ``path`` is unknown or cannot carry ``codec``'s payloads."""
    _base.check_choice("path", path, PATHS)
    if path == "psum" and codec.reduction is not compressors.Reduction.SUM:
        raise ValueError(
            f"path='psum' needs a summable codec (Reduction.SUM: identity, cast, rand_k); "
            f"{codec.name} is {codec.reduction.value}. Use 'all_gather' or 'two_phase'."
        )
    if path == "low_rank" and codec.reduction is not compressors.Reduction.LOW_RANK:
        raise ValueError(f"path='low_rank' needs a power_sgd codec; got {codec.name}.")
    if path == "two_phase" and codec.reduction is compressors.Reduction.LOW_RANK:
        raise ValueError(
            f"path='two_phase' compresses 1-D chunks, which {codec.name} leaves uncompressed; "
            "use 'low_rank' (or 'auto')."
        )


def check_channel(channel: feedback.Channel) -> None:
    """Raises ``ValueError`` for channels a gradient mean cannot drive (per-sample buffers)."""
    if channel.per_sample:
        raise ValueError(
            f"{channel.name} keeps per-sample buffers (AQ-SGD); a gradient mean has no sample "
            "ids. Use feedback.error_feedback or feedback.ef21 without num_samples."
        )


def plan_path(
    codec: compressors.Codec,
    like: Any,
    *,
    path: str = "auto",
    min_compression_rate: float = 2.0,
    min_ndim: int = 2,
) -> tuple[str, str]:
    """Chooses the path for one array; returns ``(path, reason)``.

    ``reason`` explains a fallback to ``"dense"`` (empty otherwise).
    """
    like = _base.as_like(like)
    if path == "dense":
        return "dense", "path='dense'"
    if len(like.shape) < min_ndim:
        return "dense", f"{len(like.shape)}-D (< min_ndim={min_ndim})"
    try:
        payload = compressors.payload_shape(codec, like)
    except (ValueError, TypeError) as err:
        return "dense", f"{codec.name} cannot compress {like.shape} {like.dtype}: {err}"
    chosen = _AUTO[codec.reduction] if path == "auto" else path
    if chosen == "low_rank" and len(like.shape) < 2:
        return "dense", f"{codec.name} leaves {len(like.shape)}-D arrays uncompressed"
    rate = compressors.dense_bytes(like) / max(compressors.wire_bytes(payload), 1)
    if rate < min_compression_rate:
        return "dense", (
            f"{codec.name} compresses {like.shape} only {rate:.2f}x "
            f"(< min_compression_rate={min_compression_rate:g})"
        )
    return chosen, ""


def init_reduce(
    channel: compressors.Codec | feedback.Channel,
    like: Any,
    axis_name: str | None,
    *,
    path: str = "auto",
    min_compression_rate: float = 2.0,
    min_ndim: int = 2,
    name: str = "",
    quiet: bool = False,
) -> Any:
    """Plans the reduction of one array and returns its initial state (call inside shard_map).

    Args:
      channel: a codec, or a channel from :mod:`jaxcomp.feedback` (plain, error feedback, EF21).
      like: the array (or ``ShapeDtypeStruct``) to be averaged.
      axis_name: the data-parallel axis, or ``None`` for a single worker.
      path: one of :data:`PATHS`; ``"auto"`` picks by ``codec.reduction``.
      min_compression_rate: arrays whose payload is not this many times smaller go ``dense``.
      min_ndim: arrays with fewer dimensions go ``dense`` (biases, norm scales: the
        reference and PyTorch's PowerSGD hook never compress 1-D tensors).
      name: the array's name in log messages.
      quiet: do not log the fallback reason.

    Returns:
      One of :class:`DenseReduce`, :class:`PsumReduce`, :class:`GatherReduce`,
      :class:`TwoPhaseReduce`, :class:`LowRankReduce`.
    """
    channel = feedback.as_channel(channel)
    codec = channel.codec
    like = _base.as_like(like)
    num_workers = axis_size(axis_name)
    chosen, reason = plan_path(
        codec, like, path=path, min_compression_rate=min_compression_rate, min_ndim=min_ndim
    )
    if chosen == "dense":
        if reason and not quiet:
            _log.info("%s: averaged uncompressed: %s", name or str(like.shape), reason)
        return DenseReduce()
    check_channel(channel)
    send, recv = channel.init(like)
    if isinstance(recv, feedback.EF21RecvState) and chosen in ("two_phase", "low_rank"):
        raise ValueError(f"{channel.name}: EF21 runs on the psum and all_gather paths only.")
    if chosen in ("psum", "all_gather"):
        cls = PsumReduce if chosen == "psum" else GatherReduce
        return cls(per_worker(send, axis_name), recv)
    if chosen == "two_phase":
        chunk = chunk_like(like, num_workers)
        send, _ = channel.init(chunk)
        send = jax.tree.map(lambda s: jnp.broadcast_to(s, (num_workers, *s.shape)), send)
        return TwoPhaseReduce(
            per_worker(send, axis_name),
            per_worker(codec.init(chunk), axis_name),
            per_worker(jnp.zeros(chunk.shape, chunk.dtype), axis_name),
        )
    if isinstance(send, feedback.ErrorFeedbackState):
        residual = per_worker(send.residual, axis_name)
    else:
        residual = compressors.EmptyState()
    with jax.ensure_compile_time_eval():  # a constant: Accordion re-initialises Q on switches
        q = codec.init(like)
    return LowRankReduce(q, residual)


def reduce_bytes(
    state: Any, channel: compressors.Codec | feedback.Channel, like: Any, axis_name: str | None
) -> int:
    """Bytes one worker puts into collectives per call (what the HLO meter reports).

    ``dense``: the array; ``psum``/``all_gather``: the payload (RandK's shared seed never
    travels); ``two_phase``: W chunk payloads into ``all_to_all`` plus one into ``all_gather``;
    ``low_rank``: the factors P and Q in ``float32``. Zero without an axis. The CPU backend
    widens 16-bit float all-reduces to ``float32`` (JAX-NOTES §2), so a cast's ``psum`` shows
    twice these bytes in CPU HLO.
    """
    if axis_name is None:
        return 0
    codec = feedback.as_channel(channel).codec
    like = _base.as_like(like)
    if isinstance(state, DenseReduce):
        return compressors.dense_bytes(like)
    if isinstance(state, TwoPhaseReduce):
        chunk = chunk_like(like, axis_size(axis_name))
        return (axis_size(axis_name) + 1) * compressors.wire_bytes(
            compressors.payload_shape(codec, chunk)
        )
    payload = compressors.payload_shape(codec, like)
    if isinstance(state, PsumReduce) and isinstance(payload, compressors.RandKPayload):
        return compressors.wire_bytes(payload.values)
    return compressors.wire_bytes(payload)
