"""Choosing the reduction of one array, and running it: :func:`plan_reduce`,
:func:`compressed_pmean`.

:func:`plan_reduce` picks the path of one array once (see :mod:`jaxcomp.comm._reduce`),
falling back to ``dense`` with a logged reason when the codec cannot handle the shape, the
array has fewer than ``min_ndim`` dimensions, or the payload is not ``min_compression_rate``
times smaller than the array, and wraps the chosen protocol in the channel's error
compensation (:func:`jaxcomp.feedback.compensate`). ``comm`` knows no codec or channel type:
it runs the :class:`~jaxcomp.compressors.ReduceProtocol` a codec brings, or builds a generic
one from the codec's contract (``reduction``, ``psum``, ``decode_sum``).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jaxcomp import _validate
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp.comm import _reduce
from jaxcomp.compressors import _base
from jaxcomp.compressors import _protocol

PATHS = ("auto", "dense", "psum", "all_gather", "two_phase", "codec")
_log = logging.getLogger(__name__)


def check_path(codec: compressors.Codec, path: str) -> None:
    """Raises ``ValueError`` if ``path`` is unknown or cannot carry ``codec``'s payloads."""
    _validate.check_choice("path", path, PATHS)
    if path == "psum" and codec.reduction is not compressors.Reduction.SUM:
        raise ValueError(
            f"path='psum' needs a summable codec (Reduction.SUM: identity, cast, rand_k); "
            f"{codec.name} is {codec.reduction.value}. Use 'all_gather' or 'two_phase'."
        )
    if path == "codec" and codec.protocol is None:
        raise ValueError(
            f"path='codec' runs the codec's own reduction protocol; {codec.name} has none "
            "(Codec.protocol is None). Use 'auto'."
        )


def check_channel(channel: feedback.Channel) -> None:
    """Raises ``ValueError`` for channels a reduction cannot drive (per-sample buffers)."""
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

    ``"auto"`` takes the codec's own protocol if it has one, else ``psum`` for summable
    codecs and ``all_gather`` for the others. ``reason`` explains a fallback to ``"dense"``
    (empty otherwise).
    """
    check_path(codec, path)
    like = _base.as_like(like)
    if path == "dense":
        return "dense", "path='dense'"
    if len(like.shape) < min_ndim:
        return "dense", f"{len(like.shape)}-D (< min_ndim={min_ndim})"
    try:
        payload = compressors.payload_shape(codec, like)
    except (ValueError, TypeError) as err:
        return "dense", f"{codec.name} cannot compress {like.shape} {like.dtype}: {err}"
    chosen = path
    if path == "auto":
        if codec.protocol is not None:
            chosen = "codec"
        else:
            chosen = "psum" if codec.reduction is compressors.Reduction.SUM else "all_gather"
    rate = compressors.dense_bytes(like) / max(compressors.wire_bytes(payload), 1)
    if rate < min_compression_rate:
        return "dense", (
            f"{codec.name} compresses {like.shape} only {rate:.2f}x "
            f"(< min_compression_rate={min_compression_rate:g})"
        )
    return chosen, ""


def plan_reduce(
    channel: compressors.Codec | feedback.Channel,
    like: Any,
    *,
    path: str = "auto",
    min_compression_rate: float = 2.0,
    min_ndim: int = 2,
    name: str = "",
    quiet: bool = False,
) -> _protocol.ReduceProtocol:
    """The reduction protocol of one array: a path for the codec, in the channel's feedback.

    Deterministic in its arguments (static shapes and Python values only), so a transform
    plans in ``init`` and again, identically, in ``update``.

    Args:
      channel: a codec, or a channel from :mod:`jaxcomp.feedback` (plain, error feedback,
        EF21), or any channel whose ``feedback`` wraps a reduction.
      like: the array (or ``ShapeDtypeStruct``) to be averaged.
      path: one of :data:`PATHS`; ``"auto"``: the codec's own protocol, else by
        ``codec.reduction``.
      min_compression_rate: arrays whose payload is not this many times smaller go ``dense``.
      min_ndim: arrays with fewer dimensions go ``dense`` (biases, norm scales: the
        reference and PyTorch's PowerSGD hook never compress 1-D tensors).
      name: the array's name in log messages.
      quiet: do not log the fallback reason.

    Returns:
      A :class:`~jaxcomp.compressors.ReduceProtocol`: ``init(like, num_workers)`` outside
      ``shard_map``, ``all_reduce(x, state, key, axis_name)`` inside any ``shard_map`` body.
      An array averaged dense gets no error compensation (it would always be zero).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import comm, compressors, feedback
      >>> g = jnp.ones((64, 32))
      >>> protocol = comm.plan_reduce(feedback.error_feedback(compressors.top_k(0.1)), g)
      >>> protocol.name
      'error_feedback(decay=1)/top_k(0.1, exact)/all_gather'
      >>> state = protocol.init(g, None)
      >>> mean, echo, state = protocol.all_reduce(g, state, None, None)  # one worker
    """
    channel = feedback.as_channel(channel)
    check_channel(channel)
    codec = channel.codec
    chosen, reason = plan_path(
        codec, like, path=path, min_compression_rate=min_compression_rate, min_ndim=min_ndim
    )
    if chosen == "dense":
        if reason and not quiet:
            _log.info("%s: averaged uncompressed: %s", name or str(tuple(like.shape)), reason)
        return _reduce.dense_protocol()
    inner = {
        "psum": _reduce.psum_protocol,
        "all_gather": _reduce.gather_protocol,
        "two_phase": _reduce.two_phase_protocol,
        "codec": lambda codec: codec.protocol,
    }[chosen](codec)
    return feedback.compensate(inner, channel.feedback)


def compressed_pmean(
    x: jax.Array,
    protocol: _protocol.ReduceProtocol,
    state: Any,
    key: jax.Array | None,
    axis_name: str | None,
) -> tuple[jax.Array, jax.Array, Any]:
    """Runs ``protocol`` on this worker's ``x`` inside ``shard_map``: the mean over the axis.

    Args:
      x: this worker's array.
      protocol: from :func:`plan_reduce` (or a codec's own ``Codec.protocol``).
      state: from ``protocol.init`` (per-worker parts as ``shard_map`` sees them) or a
        previous call.
      key: PRNG key, identical on every worker, or ``None`` for deterministic codecs.
      axis_name: the data axis, or ``None`` for a single worker.

    Returns:
      ``(mean, echo, state)``: the mean (replicated, ``x``'s dtype), this worker's own share
      as decoded (for callers doing their own error feedback), and the new state.

    Example:
      >>> # inside jax.shard_map(..., mesh=mesh) over "data", with state = protocol.init(g, W)
      >>> # mean, _, state = comm.compressed_pmean(g, protocol, state, key, "data")
    """
    _protocol.axis_size(axis_name)  # a clear error for a wrong axis or outside shard_map
    return protocol.all_reduce(x, state, key, axis_name)


def dense_round(
    x: jax.Array, protocol: _protocol.ReduceProtocol, state: Any, axis_name: str | None
) -> tuple[jax.Array, Any]:
    """Averages ``x`` uncompressed (``pmean``) and lets the protocol's state follow (warm-up).

    Error-feedback residuals are left as they are; EF21 estimates are set to the dense values.
    """
    _protocol.axis_size(axis_name)
    mean = _protocol.pmean(x, axis_name)
    if protocol.dense is not None:
        state = protocol.dense(x, mean, state, axis_name)
    return mean, state
