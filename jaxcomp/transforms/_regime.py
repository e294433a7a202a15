"""Accordion's critical-regime detector (shared by both Accordion transforms).

Used by :func:`~jaxcomp.transforms.accordion` and :func:`~jaxcomp.transforms.accordion_batch_size`.
The statistic is the norm of a worker's local gradient summed over an interval (the
reference's epoch); every ``T`` intervals it is compared with its value ``T`` intervals
earlier (:func:`critical_regime`), after one tiny all-reduce has made it identical on every
worker (:func:`replicated_norms`). A learning-rate decrease (:func:`current_lr`) also counts as
critical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp import _regime as _critical
from jaxcomp import _finite
from jaxcomp import _scaling
from jaxcomp import _validate
from jaxcomp._regime import critical_regime  # noqa: F401 (re-exported)
from jaxcomp._regime import replicated_norms  # noqa: F401 (re-exported)

STATISTICS = _critical.STATISTICS


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
    :func:`jaxcomp._finite.all_finite` (few kernels: ``accordion_batch_size`` of 12 leaves
    compiled 57 fusions, 72 with a 2-norm per leaf before this function).
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


def current_lr(learning_rate: Any, extra_args: dict, count: jax.Array) -> jax.Array | None:
    """This step's learning rate: ``extra_args['learning_rate']``, else the schedule or value."""
    lr = extra_args.get("learning_rate", learning_rate)
    if lr is None:
        return None
    if callable(lr):
        lr = lr(count)
    return jnp.asarray(lr, jnp.float32)


def check_detector_args(interval_steps, check_every, eta, statistic, learning_rate) -> None:
    """Construction-time validation shared by :func:`accordion` and the batch-size variant."""
    _validate.static_int("interval_steps", interval_steps, 1)
    _validate.static_int("check_every", check_every, 1)
    if not _validate.is_array(eta):  # an array: a hyperparameter (optax.inject_hyperparams)
        _validate.check_number("eta", eta, gt=0)
    _validate.check_choice("statistic", statistic, STATISTICS)
    ok = learning_rate is None or callable(learning_rate)
    ok = ok or _validate.is_number(learning_rate) or _validate.is_array(learning_rate)
    if not ok:
        raise ValueError(
            "learning_rate must be None, a number or a schedule (step -> lr); "
            f"got {learning_rate!r}."
        )


def find_states(opt_state: Any, cls: type) -> list:
    """The one ``cls`` node in an optimizer state (e.g. of an ``optax.chain``), as a 1-list."""
    found = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, cls))
        if isinstance(node, cls)
    ]
    if not found:
        raise ValueError(f"no {cls.__name__} found in the optimizer state.")
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} {cls.__name__}s found; pass the one you want (e.g. opt_state[0])."
        )
    return found
