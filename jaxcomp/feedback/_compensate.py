"""Error compensation around any reduction protocol: the reduction form of a channel.

A channel's :class:`Feedback` says what its sender does to a signal before a multi-worker
reduction and what it keeps afterwards (EF: add the residual, keep ``x + e - echo``; EF21: send
the change of an estimate). It wraps *any* :class:`~jaxcomp.compressors.ReduceProtocol`
(``psum``, ``all_gather``, two-phase, PowerSGD's own, a user's) without knowing it, so each
method is written once::

  protocol = compensate(inner, channel.feedback)   # what jaxcomp.comm.plan_reduce does
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

from jaxcomp.compressors import _protocol

Run = Callable[[jax.Array], tuple[jax.Array, jax.Array, Any]]


class Feedback(NamedTuple):
    """A channel's error compensation, as a wrapper of a reduction.

    Attributes:
      init: ``init(like) -> memory``: the compensation's own state (per-worker parts wrapped
        in :class:`~jaxcomp.compressors.PerWorker`).
      reduce: ``reduce(x, memory, run, axis_name, in_place=False) -> (mean, echo, memory,
        aux)``, where ``run(c) -> (mean, echo, aux)`` averages ``c`` over the workers with the
        wrapped protocol (``aux``: whatever ``run`` carries, e.g. the wrapped protocol's new
        state), and ``run(c, into=(base, sign)) -> (mean, echo, base + sign * echo, aux)``
        also gives the echo added into ``base`` (``sign``: 1 or -1; see
        :func:`~jaxcomp.compressors.add_decoded`). ``in_place`` says whether that sum is made
        in place, without a dense echo (the wrapped protocol has
        ``ReduceProtocol.all_reduce_into``: a codec with ``Codec.add_decoded``, e.g. TopK's
        scatter); when it is ``False`` the sum is ``base + sign * echo`` and the compensation
        may form it itself, in whatever layout lets XLA update its memory in place.
      dense: ``dense(x, mean, memory, axis_name) -> memory``: the memory after a round that
        averaged ``x`` uncompressed into ``mean`` (warm-up).
      name: the compensation and its parameters without the codec, e.g.
        ``"error_feedback(decay=1.0)"``; two channels with equal names compensate alike (so
        Accordion can share one memory between its two codecs).
      needs_exact_mean: the wrapped protocol must return the exact mean of the workers'
        echoes (``ReduceProtocol.exact_mean``).
    """

    init: Callable[[Any], Any]
    reduce: Callable[..., tuple[jax.Array, jax.Array, Any, Any]]
    dense: Callable[..., Any]
    name: str
    needs_exact_mean: bool = False


class Compensated(NamedTuple):
    """State of a protocol wrapped by :func:`compensate`.

    Attributes:
      memory: the compensation's memory (e.g. :class:`ErrorFeedbackMemory`).
      inner: the wrapped protocol's state.
    """

    memory: Any
    inner: Any


def compensate(
    inner: _protocol.ReduceProtocol, feedback: Feedback | None
) -> _protocol.ReduceProtocol:
    """``inner`` with ``feedback`` around it (``inner`` itself for ``None``).

    Raises:
      ValueError: if ``feedback`` needs an exact mean that ``inner`` does not give.
    """
    if feedback is None:
        return inner
    if feedback.needs_exact_mean and not inner.exact_mean:
        raise ValueError(
            f"{feedback.name} needs a reduction whose mean is exactly the mean of the workers' "
            f"echoes (EF21 keeps the receivers' estimate equal to the mean of the senders'); "
            f"{inner.name} re-compresses the mean. Use the psum or all_gather path, or the "
            "codec's own protocol."
        )

    def init(like, num_workers=None):
        return Compensated(feedback.init(like), inner.init(like, num_workers))

    def all_reduce(x, state, key, axis_name):
        def run(c, into=None):
            if into is None:
                return inner.all_reduce(c, state.inner, key, axis_name)
            return _protocol.all_reduce_into(inner, c, state.inner, key, axis_name, *into)

        mean, echo, memory, inner_state = feedback.reduce(
            x, state.memory, run, axis_name, in_place=inner.all_reduce_into is not None
        )
        return mean, echo, Compensated(memory, inner_state)

    def dense(x, mean, state, axis_name):
        inner_state = state.inner
        if inner.dense is not None:
            inner_state = inner.dense(x, mean, inner_state, axis_name)
        return Compensated(feedback.dense(x, mean, state.memory, axis_name), inner_state)

    return _protocol.ReduceProtocol(
        init,
        all_reduce,
        inner.wire_bytes,
        f"{feedback.name}/{inner.name}",
        dense,
        inner.exact_mean,
    )
