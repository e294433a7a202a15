"""Accordion's critical-regime test and its replicated statistic, shared by every user.

Accordion's detector (Agarwal et al., 2021) is used by two layers at the same level:
:mod:`jaxcomp.transforms` (``accordion``, ``accordion_batch_size``: gradient norms over a data
axis) and :mod:`jaxcomp.pipeline` (adaptive links: activation and activation-gradient norms at a
stage boundary). Neither may import the other, so the math lives here, below both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _scaling

LOW_COMPRESSION = 0  #: mode in a critical regime: the low-compression codec or link
HIGH_COMPRESSION = 1  #: mode otherwise: the high-compression codec or link
STATISTICS = ("worker0", "mean")  #: whose norms decide: worker 0's or the workers' mean


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


def replicated_norms(norms: jax.Array, axis_name: str | None, statistic: str) -> jax.Array:
    """Makes per-worker norms identical on every worker with one tiny all-reduce.

    ``"worker0"``: worker 0's values (the reference broadcasts rank 0's decision);
    ``"mean"``: the mean over workers of their local norms (finite for finite norms, even
    near the largest float32; norms below ``2**(j - 126)``, ``2**j >= n`` workers, flush to 0).
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
