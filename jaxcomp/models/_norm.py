"""The models' normalisation layers: exact variance; BatchNorm with PyTorch's momentum and sync.

Every layer here computes the variance in two passes, as the mean of ``(x - mean)^2``: Flax's
default ``E[x^2] - E[x]^2`` (``use_fast_variance=True``) in float32 is off by several percent
once the mean is ~1e3 times the spread, and by more than the variance itself beyond ~1e4
(GroupNorm and LayerNorm normalise every sample with its own statistics, so one sample with a
large offset is enough). :func:`layer_norm` and :func:`group_norm` are Flax's layers with
``use_fast_variance=False``; the models use them instead of ``nn.LayerNorm``/``nn.GroupNorm``.

BatchNorm is Flax's :class:`flax.linen.BatchNorm` with ``use_fast_variance=False``, PyTorch's
defaults (running-average momentum 0.1, i.e. Flax's 0.9; eps 1e-5), and one change for the
synchronised form: the batch mean and variance, all-reduced over ``axis_name`` and so invariant
over it, are marked *varying* over it before they normalise ``x``. The numbers and collectives
are the same (JAX inserts that cast at the first use of an invariant value beside a varying one
anyway); what changes is that every value the backward keeps is varying, so a pipeline stage
can store them with its other activations and feed them back to its pullback
(:mod:`jaxcomp.pipeline._residuals`). The running averages are updated from the invariant
statistics, so they stay replicated in data parallelism.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import normalization as _flax_norm

from jaxcomp.comm import _local

NORMS = ("batch", "group", "layer")


class BatchNorm(nn.BatchNorm):
    """:class:`flax.linen.BatchNorm` whose synchronised statistics are typed varying.

    Same fields, variables (``params``: ``scale``, ``bias``; ``batch_stats``: ``mean``,
    ``var``) and numbers as Flax's; see the module docstring for the one change.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> bn = BatchNorm(use_running_average=False, use_fast_variance=False)
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> variables = bn.init(jax.random.key(0), x)
      >>> y, updates = bn.apply(variables, x, mutable=["batch_stats"])
      >>> [round(m, 3) for m in updates["batch_stats"]["mean"].tolist()]  # momentum 0.99
      [0.03, 0.04]
    """

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        use_running_average = nn.module.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        feature_axes = _flax_norm._canonicalize_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = [x.shape[ax] for ax in feature_axes]
        stat_dtype = "float32" if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable(
            "batch_stats", "mean", lambda s: jnp.zeros(s, stat_dtype), feature_shape
        )
        ra_var = self.variable(
            "batch_stats", "var", lambda s: jnp.ones(s, stat_dtype), feature_shape
        )
        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
            if not self.force_float32_reductions:
                mean = jnp.asarray(mean, self.param_dtype)
                var = jnp.asarray(var, self.param_dtype)
        else:
            synced = self.axis_name is not None and not self.is_initializing()
            mean, var = _flax_norm._compute_stats(
                x,
                reduction_axes,
                dtype=self.dtype,
                axis_name=self.axis_name if synced else None,
                axis_index_groups=self.axis_index_groups,
                use_fast_variance=self.use_fast_variance,
                mask=mask,
                force_float32_reductions=self.force_float32_reductions,
            )
            if not self.is_initializing():
                ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
                ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
            if synced:
                mean, var = _local.to_varying((mean, var), self.axis_name)
        return _flax_norm._normalize(
            self, x, mean, var, reduction_axes, feature_axes, self.dtype, self.param_dtype,
            self.epsilon, self.use_bias, self.use_scale, self.bias_init, self.scale_init,
            self.force_float32_reductions,
        )  # fmt: skip


def batch_norm(train: bool, batch_axis: str | None = None, name: str | None = None) -> BatchNorm:
    """The models' BatchNorm: PyTorch's momentum and eps, exact variance, optionally synced.

    Args:
      train: normalise with the batch's statistics and update the running averages (else use
        the running averages).
      batch_axis: a mesh axis to synchronise the statistics over (SyncBatchNorm), or ``None``.
      name: the module name (``None``: Flax's automatic one).

    Returns:
      A :class:`BatchNorm`.
    """
    return BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        axis_name=batch_axis,
        use_fast_variance=False,
        name=name,
    )


def layer_norm(name: str | None = None) -> nn.LayerNorm:
    """Flax's LayerNorm over the last axis with the two-pass variance.

    ``y = (x - mean) / sqrt(var + 1e-6) * scale + bias``, ``mean`` and ``var = mean((x -
    mean)^2)`` over the last axis of each sample.

    Args:
      name: the module name (``None``: Flax's automatic one).

    Returns:
      A :class:`flax.linen.LayerNorm` with ``use_fast_variance=False``.
    """
    return nn.LayerNorm(use_fast_variance=False, name=name)


def group_norm(group_size: int = 8, name: str | None = None) -> nn.GroupNorm:
    """Flax's GroupNorm over groups of ``group_size`` channels with the two-pass variance.

    Each sample's channels (last axis) are split into groups of ``group_size``; each group is
    normalised with the mean and variance (``mean((x - mean)^2)``) over its channels and all
    spatial positions, then scaled and shifted per channel.

    Args:
      group_size: channels per group (the channel count must be a multiple).
      name: the module name (``None``: Flax's automatic one).

    Returns:
      A :class:`flax.linen.GroupNorm` with ``use_fast_variance=False``.
    """
    return nn.GroupNorm(num_groups=None, group_size=group_size, use_fast_variance=False, name=name)


def layer(
    kind: str, train: bool, batch_axis: str | None = None, name: str | None = None
) -> nn.Module:
    """The normalisation layer ``kind`` of :data:`NORMS`, as the models use it.

    ``"batch"`` is :func:`batch_norm`: PyTorch's defaults (running-average momentum 0.1, i.e.
    Flax's 0.9; eps 1e-5), the variance as the mean of ``(x - mean)^2`` (two passes; ``E[x^2]
    - E[x]^2`` in float32 is off by several percent once the mean is ~1e3 times the spread, and
    by more than the variance itself beyond ~1e4). With ``batch_axis`` the statistics are those
    of the batch concatenated over that mesh axis (SyncBatchNorm): the mean of the workers'
    means, the variance the mean of their ``E[(x - mean)^2]`` around that global mean (equal
    shards). Running variances are the biased batch variances (PyTorch keeps the unbiased ones,
    a factor ``n / (n - 1)`` apart, n = samples x pixels per channel). ``"group"`` is
    :func:`group_norm` (groups of 8 channels), ``"layer"`` :func:`layer_norm` (both stateless,
    same two-pass variance).

    Args:
      kind: one of :data:`NORMS`.
      train: BatchNorm: normalise with the batch's statistics (else the running averages).
      batch_axis: BatchNorm: the mesh axis to synchronise over, or ``None``.
      name: the module name (``None``: Flax's automatic one).

    Returns:
      A Flax module.
    """
    if kind == "batch":
        return batch_norm(train, batch_axis, name)
    if kind == "group":
        return group_norm(8, name)
    if kind == "layer":
        return layer_norm(name)
    raise ValueError(f"norm must be one of {NORMS}; got {kind!r}.")
