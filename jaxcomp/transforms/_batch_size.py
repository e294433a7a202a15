"""Accordion's batch-size variant: small batches in critical regimes, large ones otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp import _regime
from jaxcomp import _validate
from jaxcomp.comm import _mesh
from jaxcomp.compressors import _protocol
from jaxcomp.transforms import _compressed_mean as _cm
from jaxcomp.transforms._accordion import find_states

LR_SCALINGS = ("linear", "sqrt", "none")


class AccordionBatchState(NamedTuple):
    """State of :func:`accordion_batch_size`.

    Attributes:
      count: ``int32[]``, micro-steps seen (calls to ``update``).
      mini_step: ``int32[]``, micro-batches summed into ``grads`` so far.
      every_k: ``int32[]``, micro-batches per optimizer update for the current accumulation.
      next_k: ``int32[]``, the detector's latest choice; it becomes ``every_k`` when a new
        accumulation starts.
      prev_norm: ``float32[]``, the regime statistic at the last check: the root-mean-square
        of ``accum`` over all its entries (:func:`jaxcomp._regime.rms`).
      last_lr: ``float32[]``, the learning rate seen at the last micro-step (NaN before any).
      accum: :class:`~jaxcomp.compressors.PerWorker` of the parameter tree (leaves
        ``[1, *shape]``): this worker's sum of the micro-batch gradients over the current
        interval times ``2**-j``, ``2**j >= interval_steps``, the detector's input.
      grads: :class:`~jaxcomp.compressors.PerWorker`: this worker's sum of the micro-batch
        gradients of the pending update times ``2**-j``, ``2**j >= large_steps``. The
        factors are exact and keep the sums of finite gradients finite (the mean of eight
        gradients near ``3e38`` was Inf).
      inner: the inner transformation's state.
    """

    count: jax.Array
    mini_step: jax.Array
    every_k: jax.Array
    next_k: jax.Array
    prev_norm: jax.Array
    last_lr: jax.Array
    accum: Any
    grads: Any
    inner: Any


def accordion_batch_size(
    inner: optax.GradientTransformation,
    *,
    interval_steps: int,
    small_steps: int = 1,
    large_steps: int = 8,
    check_every: int = 10,
    eta: float = 0.5,
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
    lr_scaling: str = "linear",
    axis_name: str | None = _mesh.DATA,
    statistic: str = "worker0",
) -> optax.GradientTransformationExtraArgs:
    r"""Accordion's detector choosing the batch size, through gradient accumulation.

    Like ``optax.MultiSteps``, but the number of micro-batches per update, ``every_k``, is
    state: ``small_steps`` in critical regimes and ``large_steps`` otherwise. Each call to
    ``update`` receives one micro-batch gradient (per worker, inside ``shard_map``); after
    ``every_k`` of them ``inner`` is applied once to their mean and the other calls return
    zero updates. Put the gradient averaging inside ``inner`` (e.g.
    ``optax.chain(compressed_mean(...), optax.sgd(...))``) so that workers communicate once
    per update: a large batch also communicates ``large_steps / small_steps`` times less.

    The detector is :func:`accordion`'s, applied to the whole model: the norm of the
    per-worker gradient summed over an interval of ``interval_steps`` micro-steps (an epoch
    is a fixed number of samples, whatever the batch size), made identical on all workers
    (``statistic``), compared every ``check_every`` intervals with the value ``check_every``
    intervals earlier (critical iff the relative change is at least ``eta``); the first interval
    is critical and a learning-rate decrease returns to the small batch. A new size takes
    effect when the pending accumulation completes. As in :func:`accordion`, the statistic (a
    root-mean-square) decides alike at magnitudes ``1e-30`` to ``3e38``, and a non-finite
    gradient makes its check and the next one choose the small batch.

    Learning-rate rule: with ``lr_scaling="linear"`` (default) the updates of a large batch
    are multiplied by ``every_k / small_steps``, which for SGD, momentum and Adam equals
    scaling the learning rate linearly with the batch size (Goyal et al., 2017); the
    learning rates you give are those of the small batch. ``"sqrt"`` scales by the square
    root; ``"none"`` keeps them. The paper's LR rule for this variant is not confirmed
    (SPEC.md §2.5); its logs switch per-worker micro-batch 32 -> 256 (8x) after epoch 20 and
    never return, with the LR schedule unchanged.

    Args:
      inner: the transformation applied to the mean of every ``every_k`` micro-batch
        gradients; it must average over ``axis_name`` when one is given.
      interval_steps: micro-steps per interval (an epoch).
      small_steps: micro-batches per update in critical regimes.
      large_steps: micro-batches per update otherwise (>= ``small_steps``).
      check_every: T, intervals between checks.
      eta: threshold on the relative norm change.
      learning_rate: schedule (indexed by micro-steps), number or ``None``, for the decrease
        rule; ``update(..., learning_rate=lr)`` overrides it.
      lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``.
      axis_name: data-parallel axis of the per-worker gradients (``None``: one worker).
      statistic: ``"worker0"`` or ``"mean"`` (see :func:`accordion`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`AccordionBatchState`. ``init``
      runs outside ``shard_map`` (per-worker sums marked
      :class:`~jaxcomp.compressors.PerWorker`; place the state with
      :func:`jaxcomp.comm.place_state`).

    Example:
      >>> import optax
      >>> from jaxcomp import compressors, transforms
      >>> tx = transforms.accordion_batch_size(
      ...     optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1)),
      ...     interval_steps=1563, small_steps=1, large_steps=8)

    References:
      Agarwal et al., `Accordion: Adaptive Gradient Communication via Critical Learning Regime
      Identification <https://arxiv.org/abs/2010.16248>`_, MLSys 2021.
      Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
      <https://arxiv.org/abs/1706.02677>`_, 2017.
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"inner must be an optax GradientTransformation; got {type(inner)!r}.")
    for name, value in (("small_steps", small_steps), ("large_steps", large_steps)):
        _validate.static_int(name, value, 1)
    if large_steps < small_steps:
        raise ValueError(f"large_steps ({large_steps}) must be >= small_steps ({small_steps}).")
    _validate.check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
    detector = _regime.Detector(interval_steps, check_every, eta, learning_rate, statistic)
    _regime.check_detector(detector)
    _validate.check_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)
    interval_down = _regime.interval_scale(interval_steps)
    grads_down = _regime.interval_scale(large_steps)

    def zeros(params, wide=False):
        def one(p):
            dtype = jnp.promote_types(p.dtype, jnp.float32) if wide else p.dtype
            return jnp.zeros((1, *jnp.shape(p)), dtype)

        return _protocol.PerWorker(jax.tree.map(one, params))

    def init_fn(params):
        return AccordionBatchState(
            count=jnp.zeros((), jnp.int32),
            mini_step=jnp.zeros((), jnp.int32),
            every_k=jnp.asarray(small_steps, jnp.int32),
            next_k=jnp.asarray(small_steps, jnp.int32),
            prev_norm=jnp.zeros((), jnp.float32),
            last_lr=jnp.asarray(jnp.nan, jnp.float32),
            accum=zeros(params, wide=True),  # an interval's sum, kept in float32 even for bf16
            grads=zeros(params),
            inner=inner.init(params),
        )

    def scale_of(every_k):
        ratio = every_k.astype(jnp.float32) / small_steps
        return {"linear": ratio, "sqrt": jnp.sqrt(ratio), "none": jnp.ones_like(ratio)}[lr_scaling]

    def update_fn(updates, state, params=None, **extra_args):
        _validate.check_tree(updates, state.grads.value, "accordion_batch_size")
        for name, g, a in zip(_cm.leaf_names(updates), jax.tree.leaves(updates),
                              jax.tree.leaves(state.grads.value)):  # fmt: skip
            if tuple(a.shape) != (1, *g.shape):
                raise ValueError(
                    f"accordion_batch_size: the state of parameter {name} is "
                    f"{_validate.describe(a)}; for an update of {_validate.describe(g)} this "
                    f"worker's part must be [1, *{tuple(g.shape)}] (inside shard_map: the specs "
                    "of jaxcomp.comm.state_specs)."
                )
        _protocol.axis_size(axis_name)
        count = state.count
        lr = _regime.current_lr(learning_rate, count, extra_args)
        next_k = state.next_k
        if lr is not None:
            next_k = jnp.where(lr < state.last_lr, small_steps, next_k).astype(jnp.int32)
        every_k = jnp.where(state.mini_step == 0, next_k, state.every_k)

        def add(down):
            return lambda acc, g: acc + g[None].astype(acc.dtype) * down

        accum = jax.tree.map(add(interval_down), state.accum.value, updates)
        grads = jax.tree.map(add(grads_down), state.grads.value, updates)
        mini_step = state.mini_step + 1
        emit = mini_step >= every_k

        def apply_inner(grads, inner_state):
            mean = jax.tree.map(lambda g: (g[0] / every_k / grads_down).astype(g.dtype), grads)
            new, inner_state = inner.update(mean, inner_state, params, **extra_args)
            scale = scale_of(every_k)
            new = jax.tree.map(lambda u: (u * scale).astype(u.dtype), new)
            return new, inner_state, jax.tree.map(jnp.zeros_like, grads)

        def hold(grads, inner_state):
            held = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
            return held, inner_state, grads

        new_updates, inner_state, grads = lax.cond(emit, apply_inner, hold, grads, state.inner)
        mini_step = jnp.where(emit, 0, mini_step)

        interval, end, check = _regime.position(detector, count)

        def decide(accum, prev_norm, next_k):
            local = _regime.rms(jax.tree.leaves(accum))
            stat = _regime.replicated_norms(local[None], axis_name, statistic)[0]
            next_k, prev_norm = _regime.decide(
                detector, interval, check, prev_norm, stat, next_k, small_steps, large_steps
            )
            reset = jax.tree.map(
                lambda a: _protocol.to_varying(jnp.zeros_like(a), _protocol.varying_axes(a)), accum
            )
            return reset, prev_norm, next_k

        accum, prev_norm, next_k = lax.cond(
            end, decide, lambda *a: a, accum, state.prev_norm, next_k
        )
        new_state = AccordionBatchState(
            count=optax.safe_increment(count),
            mini_step=mini_step,
            every_k=jnp.where(mini_step == 0, next_k, every_k),
            next_k=next_k,
            prev_norm=prev_norm,
            last_lr=state.last_lr if lr is None else lr,
            accum=_protocol.PerWorker(accum),
            grads=_protocol.PerWorker(grads),
            inner=inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def batch_size_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """``{"every_k", "mini_step", "count"}`` of the :class:`AccordionBatchState` in a state."""
    (state,) = find_states(opt_state, AccordionBatchState)
    return {"every_k": state.every_k, "mini_step": state.mini_step, "count": state.count}
