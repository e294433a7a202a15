r"""Accordion's critical-regime detector: its settings, its statistic and its update rule.

Accordion (Agarwal et al., 2021) compresses less while training is in a *critical regime*. Three
users share this detector, each with its own statistic and its own state layout:

* :func:`jaxcomp.transforms.accordion`: per parameter, the root-mean-square of the worker's
  gradient summed over an interval (:func:`rms`), choosing one of two codecs;
* :func:`jaxcomp.transforms.accordion_batch_size`: the same statistic over the whole model,
  choosing the number of accumulated micro-batches;
* the pipeline's adaptive links (:func:`jaxcomp.pipeline.adaptive_link`): per boundary and
  direction, the 2-norm of what the link sent over the interval, choosing one of two links.

They live in :mod:`jaxcomp.transforms` and :mod:`jaxcomp.pipeline`, which may not import each
other, so the detector lives here, below both. Each user keeps, per decision, a ``mode`` and the
statistic at the last check ``prev_norm``, and a step ``count``; the rule is the same for all:

.. math::
  e = \lfloor \text{count} / \text{interval\_steps} \rfloor, \qquad
  \text{check} \iff (\text{count} + 1) \bmod \text{interval\_steps} = 0 \ \land\
  e \bmod T = 0,

at a check the mode becomes :func:`critical_regime`'s answer (:func:`decide`) and ``prev_norm``
the interval's statistic; in between the mode holds, except that a learning-rate decrease
(:func:`current_lr`) switches to the critical regime's mode at once.

References:
  Agarwal et al., `Accordion: Adaptive Gradient Communication via Critical Learning Regime
  Identification <https://arxiv.org/abs/2010.16248>`_, MLSys 2021.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _finite
from jaxcomp import _scaling
from jaxcomp import _validate

LOW_COMPRESSION = 0  #: mode in a critical regime: the low-compression codec or link
HIGH_COMPRESSION = 1  #: mode otherwise: the high-compression codec or link
STATISTICS = ("worker0", "mean")  #: whose norms decide: worker 0's or the workers' mean


class Detector(NamedTuple):
    """Accordion's detector settings.

    Attributes:
      interval_steps: steps per interval (the reference's epoch); a Python int >= 1.
      check_every: ``T``, intervals between checks (10 in the reference's CNN runs).
      eta: the threshold on the relative norm change (0.5).
      learning_rate: ``None``, a number, or a schedule ``step -> lr``: a decrease between two
        steps switches to the critical regime's mode (piecewise-constant schedules; a smooth
        decay triggers at every step).
      statistic: with several workers or replicas, ``"worker0"`` (worker 0's norms decide, the
        reference's rank 0) or ``"mean"`` (the mean of the workers' norms).

    Example:
      >>> from jaxcomp import pipeline
      >>> pipeline.Detector(interval_steps=391, check_every=10).eta
      0.5
    """

    interval_steps: int
    check_every: int = 10
    eta: float = 0.5
    learning_rate: Any = None
    statistic: str = "worker0"


def check_detector(detector: Detector, prefix: str = "", *, static: bool = False) -> Detector:
    """Validates ``detector``'s settings; returns it.

    Args:
      detector: the settings.
      prefix: put before each setting's name in the messages (e.g. ``"detector."``).
      static: the settings must be Python values (hashable: they key compiled programs);
        otherwise ``eta`` and ``learning_rate`` may be arrays (``optax.inject_hyperparams``).

    Raises:
      ValueError: naming the first invalid setting and what it must be.
    """
    _validate.static_int(f"{prefix}interval_steps", detector.interval_steps, 1)
    _validate.static_int(f"{prefix}check_every", detector.check_every, 1)
    eta, lr = detector.eta, detector.learning_rate
    if static and _validate.is_array(eta):
        raise ValueError(f"{prefix}eta must be a Python number > 0; got {eta!r}.")
    if not _validate.is_array(eta):
        _validate.check_number(f"{prefix}eta", eta, gt=0)
    _validate.check_choice(f"{prefix}statistic", detector.statistic, STATISTICS)
    ok = lr is None or callable(lr) or _validate.is_number(lr)
    if not ok and not static:
        ok = _validate.is_array(lr)
    if not ok:
        raise ValueError(
            f"{prefix}learning_rate must be None, a number or a schedule (step -> lr); got {lr!r}."
        )
    return detector


def position(detector: Detector, count: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where step ``count`` (0-based) stands: ``(interval, end, check)``, its interval
    ``e = count // interval_steps``, whether it ends ``e``, and whether that end is a check
    (``e % check_every == 0``)."""
    interval = count // detector.interval_steps
    end = (count + 1) % detector.interval_steps == 0
    return interval, end, jnp.logical_and(end, interval % detector.check_every == 0)


def critical_regime(prev_norm: jax.Array, norm: jax.Array, eta: Any, first: Any) -> jax.Array:
    r"""Accordion's test: is the interval that produced ``norm`` in a critical regime?

    .. math::
      r = \frac{|\,\|\Delta(e-T)\| - \|\Delta(e)\|\,|}{\|\Delta(e-T)\|}
      \ (r = 9 \text{ if } \|\Delta(e-T)\| = 0), \qquad \text{critical} \iff
      e = 0 \ \lor\ \lnot (r < \eta)

    ``not (r < eta)`` rather than ``r >= eta`` so that a non-finite statistic counts as
    critical (low compression), as in the reference; a non-finite ``prev_norm`` too (the check
    after a non-finite statistic has no baseline).
    """
    safe = jnp.where(prev_norm != 0, prev_norm, 1.0)
    ratio = jnp.where(prev_norm != 0, jnp.abs(prev_norm - norm) / safe, 9.0)
    return jnp.logical_or(first, jnp.logical_not(ratio < eta))


def decide(
    detector: Detector,
    interval: jax.Array,
    check: jax.Array,
    prev_norm: jax.Array,
    norm: jax.Array,
    mode: jax.Array,
    critical: Any = LOW_COMPRESSION,
    other: Any = HIGH_COMPRESSION,
) -> tuple[jax.Array, jax.Array]:
    """The update at an interval end: ``(mode, prev_norm)`` after the interval whose statistic
    is ``norm`` (from :func:`position`'s ``interval`` and ``check``).

    At a check the mode becomes ``critical`` where :func:`critical_regime` says so and
    ``other`` elsewhere (``int32``), and ``prev_norm`` becomes ``norm``; otherwise both hold.
    ``critical``/``other`` default to :data:`LOW_COMPRESSION`/:data:`HIGH_COMPRESSION` (the
    batch-size variant passes its small and large accumulation lengths).
    """
    is_critical = critical_regime(prev_norm, norm, detector.eta, interval == 0)
    decided = jnp.where(is_critical, critical, other).astype(jnp.int32)
    return jnp.where(check, decided, mode), jnp.where(check, norm, prev_norm)


def current_lr(learning_rate: Any, count: jax.Array, extra_args: dict | None = None):
    """The learning rate at step ``count`` as ``float32``: ``extra_args['learning_rate']`` when
    given, else the schedule's value or the number; ``None`` without any (it never drops)."""
    lr = (extra_args or {}).get("learning_rate", learning_rate)
    if lr is None:
        return None
    if callable(lr):
        lr = lr(count)
    return jnp.asarray(lr, jnp.float32)


def replicated_norms(norms: jax.Array, axis_name: Any, statistic: str) -> jax.Array:
    """Makes per-worker norms identical on every worker with one tiny all-reduce.

    ``"worker0"``: worker 0's values (the reference broadcasts rank 0's decision);
    ``"mean"``: the mean over workers of their local norms (finite for finite norms, even
    near the largest float32; norms below ``2**(j - 126)``, ``2**j >= n`` workers, flush to 0).
    ``axis_name`` may be a tuple of axes; ``None``: one worker, nothing to do.
    """
    if axis_name is None:
        return norms
    if statistic == "worker0":
        mine = jnp.where(lax.axis_index(axis_name) == 0, norms, jnp.zeros_like(norms))
        return lax.psum(mine, axis_name)
    # the mean of finite values is finite: sum them scaled by 2**-j >= 1 / n (exact), so the
    # sum of n values up to 3e38 does not overflow; bit-identical to pmean below that
    n = lax.axis_size(axis_name)
    k = _scaling.sum_exponent(n)
    return _scaling.mean_of_sum(lax.psum(norms * 2.0**-k, axis_name), n, k)


# ----------------------------------------------------------------------------------------------
# The transforms' statistic: the root-mean-square of a gradient summed over an interval


def interval_scale(steps: int) -> float:
    """``2**-j``, ``2**j >= steps``: an accumulator of ``steps`` finite gradients each times
    this factor cannot overflow (an interval's plain sum of gradients near ``3e38`` did), and
    the factor is exact, so the statistic's relative changes are the plain sum's."""
    return 2.0 ** -_scaling.sum_exponent(steps)


def rms(arrays: Sequence[jax.Array]) -> jax.Array:
    r"""``float32`` root-mean-square of all the entries of ``arrays``, at any magnitude.

    .. math::
      \operatorname{rms}(a) = \frac1k \sqrt{\frac1N \sum_i (k a_i)^2}, \qquad
      k = 2^{-e},\ \max_i |a_i| = m\,2^e,\ m \in [0.5, 1)

    Scaling by the power of two ``k`` is exact and keeps the squares from overflowing (entries
    above ``~1e19``) or flushing to zero (below ``~1e-19``); the root-mean-square of finite
    values is at most their max-abs, so it is finite, unlike the 2-norm of more than one entry
    near ``3e38``. NaN or Inf anywhere gives a non-finite result. The arrays are reduced as
    concatenations of at most :data:`jaxcomp._finite.FINITE_GROUP_SIZE` entries, as
    :func:`jaxcomp._finite.all_finite` (few kernels, whatever the number of leaves).
    """
    groups = _finite.capped_groups([a.astype(jnp.float32) for a in arrays])
    flat = [jnp.concatenate([jnp.ravel(a) for a in g]) for g in groups]
    if not flat:
        return jnp.zeros((), jnp.float32)
    amax = jnp.max(jnp.stack([jnp.max(jnp.abs(a), initial=0.0) for a in flat]))
    k = _scaling.pow2_inverse(amax)
    total = sum(jnp.sum(jnp.square(a * k)) for a in flat)
    size = sum(a.size for a in flat)
    return jnp.sqrt(total / max(size, 1)) / k


def local_norm(accum: jax.Array) -> jax.Array:
    """The regime statistic of a worker's accumulator (leading worker axis of size 1): its
    root-mean-square (:func:`rms`), the 2-norm over a constant, so the same relative changes
    at every magnitude."""
    return rms([accum])
