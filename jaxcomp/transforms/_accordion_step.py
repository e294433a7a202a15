"""Accordion's state and its ``init``/``update`` as module-level functions of a frozen config.

:func:`jaxcomp.transforms.accordion` validates its arguments into an :class:`AccordionConfig`
and returns ``init_accordion`` and ``update_accordion`` bound to it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp import _regime
from jaxcomp import _validate
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp._regime import HIGH_COMPRESSION
from jaxcomp._regime import LOW_COMPRESSION
from jaxcomp.comm import _local
from jaxcomp.comm import _reduce
from jaxcomp.comm import _reduce_plan
from jaxcomp.comm import _reduce_shards
from jaxcomp.compressors import _protocol
from jaxcomp.transforms import _compressed_mean as _cm

UNCOMPRESSED = -1  #: reported for parameters averaged uncompressed in both modes


class AccordionLeaf(NamedTuple):
    """Per-parameter state of :func:`accordion` (parameters compressed in some mode).

    Attributes:
      mode: ``int32[]``, :data:`LOW_COMPRESSION` or :data:`HIGH_COMPRESSION` (replicated).
      prev_norm: ``float32[]``, the regime statistic at the last check (replicated): the
        root-mean-square of ``accum`` (:func:`jaxcomp._regime.rms`).
      accum: :class:`~jaxcomp.compressors.PerWorker` of ``[1, *shape]``: this worker's sum of
        its local gradients over the current interval (before compression and feedback),
        times ``2**-j``, ``2**j >= interval_steps`` (exact; it cannot overflow).
      memory: the channels' error-compensation memory, shared by both modes (e.g.
        :class:`~jaxcomp.feedback.ErrorFeedbackMemory`);
        :class:`~jaxcomp.compressors.EmptyState` without feedback.
      low: reduction state of the low-compression codec's protocol.
      high: reduction state of the high-compression codec's protocol.
    """

    mode: jax.Array
    prev_norm: jax.Array
    accum: _protocol.PerWorker
    memory: Any
    low: Any
    high: Any


class AccordionState(NamedTuple):
    """State of :func:`accordion`.

    Attributes:
      count: ``int32[]``, steps taken; interval ``e = count // interval_steps``.
      key: ``uint32[2]``, raw PRNG key data for stochastic codecs.
      last_lr: ``float32[]``, the learning rate seen at the last step (NaN before any).
      bytes_sent: ``float32[]``, bytes this worker put into collectives at the last step
        (with an axis pair: over the slow axis, the compressed payloads and the statistic).
      leaves: per parameter, an :class:`AccordionLeaf`, or a
        :class:`jaxcomp.comm.DenseReduce` for parameters never compressed.
      fast_bytes_sent: ``float32[]``, bytes this worker put into the dense average over the
        fast axis of an axis pair at the last step (0 without one).
    """

    count: jax.Array
    key: jax.Array
    last_lr: jax.Array
    bytes_sent: jax.Array
    leaves: Any
    fast_bytes_sent: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class AccordionConfig:
    """The validated static configuration of :func:`accordion` (see its arguments).

    ``low`` and ``high`` are channels with the same error compensation, ``feedback``;
    ``detector`` the regime detector's settings (:class:`jaxcomp._regime.Detector`).
    ``axis_name`` is the axis the codecs reduce over (the slow axis of a pair), ``fast_axis``
    the fast axis of a pair, averaged densely first (``None`` without one).
    """

    low: feedback.Channel
    high: feedback.Channel
    feedback: feedback.Feedback | None
    detector: _regime.Detector
    axis_name: str | None
    fast_axis: str | None
    reset_on_switch: bool
    reset_memory_on_switch: bool
    path: str
    min_compression_rate: float
    min_ndim: int
    seed: int
    shard_fast: bool = False

    def protocols(self, like: Any, name: str = "", quiet: bool = True):
        """``{mode: protocol}`` of one parameter (without the feedback), or ``None`` when both
        modes average it uncompressed."""
        plan = functools.partial(
            _reduce_plan.plan_reduce, like=like, path=self.path, name=name, quiet=quiet,
            min_compression_rate=self.min_compression_rate, min_ndim=self.min_ndim,
        )  # fmt: skip
        out = {LOW_COMPRESSION: plan(self.low.codec), HIGH_COMPRESSION: plan(self.high.codec)}
        if all(p.name == "dense" for p in out.values()):
            return None
        return out


def is_leaf_state(node: Any) -> bool:
    return isinstance(node, (AccordionLeaf, _reduce.DenseReduce))


# ----------------------------------------------------------------------------------------------
# init


def init_leaf(
    config: AccordionConfig, like: Any, num_workers: int | None, name: str = "", quiet=True
):
    """The state of one parameter: an :class:`AccordionLeaf` (or ``DenseReduce``)."""
    protocols = config.protocols(like, name, quiet)
    if protocols is None:
        return _reduce.DenseReduce()
    wide = jnp.promote_types(like.dtype, jnp.float32)  # an interval's sum, even of bf16
    memory = compressors.EmptyState() if config.feedback is None else config.feedback.init(like)
    leaf = AccordionLeaf(
        mode=jnp.asarray(LOW_COMPRESSION, jnp.int32),
        prev_norm=jnp.zeros((), jnp.float32),
        accum=_protocol.per_worker_zeros(like, wide),
        memory=memory,
        low=protocols[LOW_COMPRESSION].init(like, num_workers),
        high=protocols[HIGH_COMPRESSION].init(like, num_workers),
    )
    if config.shard_fast:  # the reduction's state is its owner's (jaxcomp.comm._reduce_shards)
        leaf = leaf._replace(**{f: _reduce_shards.init_per_device(getattr(leaf, f)) for f in OWNED})
    return leaf


#: the fields of an :class:`AccordionLeaf` a sharded mean keeps per device (its owner's)
OWNED = ("memory", "low", "high")


def _owned(leaf: AccordionLeaf) -> tuple:
    return tuple(getattr(leaf, f) for f in OWNED)


def _with_owned(leaf: AccordionLeaf, part: tuple) -> AccordionLeaf:
    return leaf._replace(**dict(zip(OWNED, part)))


def init_accordion(config: AccordionConfig, params: Any) -> AccordionState:
    """``accordion``'s ``init`` (outside ``shard_map``; see :func:`accordion`)."""
    num_workers = _protocol.num_workers(config.axis_name)
    flat, treedef = jax.tree.flatten(params)
    names = _cm.leaf_names(params)
    leaves = [init_leaf(config, p, num_workers, n, False) for p, n in zip(flat, names)]
    return AccordionState(
        count=jnp.zeros((), jnp.int32),
        key=_cm.seed_key(config.seed),
        last_lr=jnp.asarray(jnp.nan, jnp.float32),
        bytes_sent=jnp.zeros((), jnp.float32),
        leaves=jax.tree.unflatten(treedef, leaves),
        fast_bytes_sent=jnp.zeros((), jnp.float32),
    )


# ----------------------------------------------------------------------------------------------
# update


def switch(config, protocols, leaf, new_mode, like, num_workers, zero_memory):
    """Sets the mode; on a change re-initialises the incoming codec's state (and, with
    ``zero_memory``, the compensation memory). Traced: the fresh states are staged computations
    (no eager PRNG key inside ``shard_map``)."""
    changed = new_mode != leaf.mode
    states = {LOW_COMPRESSION: leaf.low, HIGH_COMPRESSION: leaf.high}
    if config.reset_on_switch:
        for mode, protocol in protocols.items():
            take = jnp.logical_and(changed, new_mode == mode)
            fresh = protocol.init(like, num_workers)
            states[mode] = jax.tree.map(
                lambda f, o, take=take: jnp.where(take, f, o), fresh, states[mode]
            )
    memory = leaf.memory
    if zero_memory and config.feedback is not None:
        fresh = config.feedback.init(like)
        memory = jax.tree.map(lambda f, o: jnp.where(changed, f, o), fresh, memory)
    return leaf._replace(
        mode=new_mode, memory=memory, low=states[LOW_COMPRESSION], high=states[HIGH_COMPRESSION]
    )


def reduce_leaf(config, protocols, g, leaf, key):
    """Averages one parameter with the codec of its mode, inside the shared compensation."""

    def run(c, into=None):
        def branch(mode):
            def reduce(c, base, low, high):
                states = {LOW_COMPRESSION: low, HIGH_COMPRESSION: high}
                if into is None:
                    mean, echo, states[mode] = protocols[mode].all_reduce(
                        c, states[mode], key, config.axis_name
                    )
                    out = (mean, echo)
                else:
                    mean, echo, added, states[mode] = _protocol.all_reduce_into(
                        protocols[mode], c, states[mode], key, config.axis_name, base, into[1]
                    )
                    out = (mean, echo, added)
                # a dense echo is this worker's c (varying), PowerSGD's the averaged
                # reconstruction (invariant): both branches return it (and base + sign * echo)
                # as varying as c
                varying = tuple(sorted(_protocol.varying_axes(c)))
                out = (out[0], *_protocol.to_varying(out[1:], varying))
                return *out, (states[LOW_COMPRESSION], states[HIGH_COMPRESSION])

            return reduce

        return lax.cond(
            leaf.mode == LOW_COMPRESSION,
            branch(LOW_COMPRESSION),
            branch(HIGH_COMPRESSION),
            c,
            None if into is None else into[0],
            leaf.low,
            leaf.high,
        )

    if config.feedback is None:
        mean, _, (low, high) = run(g)
        memory = leaf.memory
    else:
        mean, _, memory, (low, high) = config.feedback.reduce(g, leaf.memory, run, config.axis_name)
    return mean, leaf._replace(memory=memory, low=low, high=high)


def end_of_interval(config, protocols, leaf, stat, like, position, num_workers):
    """The detector's decision (at a check: :func:`jaxcomp._regime.decide`) and the accumulator
    reset at an interval end; ``position`` is :func:`jaxcomp._regime.position`'s."""
    interval, end, check = position
    new_mode, prev_norm = _regime.decide(
        config.detector, interval, check, leaf.prev_norm, stat, leaf.mode
    )
    leaf = switch(
        config, protocols, leaf, new_mode, like, num_workers, config.reset_memory_on_switch
    )
    accum = jnp.where(end, 0, leaf.accum.value).astype(leaf.accum.value.dtype)
    return leaf._replace(prev_norm=prev_norm, accum=_protocol.PerWorker(accum))


def update_accordion(
    config: AccordionConfig, updates: Any, state: AccordionState, params: Any = None, **extra
) -> tuple[Any, AccordionState]:
    """``accordion``'s ``update`` (inside ``shard_map`` over ``config.axis_name``, and
    ``config.fast_axis`` with an axis pair)."""
    del params
    axis_name = config.axis_name
    _validate.check_tree(updates, state.leaves, "accordion")
    fast_sent = jnp.zeros((), jnp.float32)
    if config.fast_axis is not None:  # dense over the fast links first: one value per group,
        # so the accumulators, their norms and the modes are the same on a group's devices
        _protocol.axis_size(config.fast_axis)  # a clear error for a wrong axis
        updates = jax.tree.map(lambda g: lax.pmean(g, config.fast_axis), updates)
        fast_sent += _protocol.reduced_bytes(updates)
    num = _protocol.axis_size(axis_name)
    flat, treedef = jax.tree.flatten(updates)
    leaf_states = treedef.flatten_up_to(state.leaves)
    names = _cm.leaf_names(updates)
    count = state.count
    lr = _regime.current_lr(config.detector.learning_rate, count, extra)
    lr_drop = None if lr is None else lr < state.last_lr
    key = _cm.step_key(state.key, count)

    means, new_leaves, detect, protocols_of = [], [], [], {}
    sharded = config.fast_axis is not None and config.shard_fast
    keys = {}
    sent = jnp.zeros((), jnp.float32)
    for i, (g, leaf) in enumerate(zip(flat, leaf_states)):
        expected = jax.eval_shape(lambda g=g: init_leaf(config, g, num))
        _validate.check_state_leaves(leaf, expected, names[i], g, "accordion")
        protocols = config.protocols(g)
        if protocols is None:
            means.append(None if sharded else _protocol.pmean(g, axis_name))
            new_leaves.append(leaf)
            if axis_name is not None:
                sent += _protocol.reduced_bytes(g)
            continue
        if sharded:
            leaf = _with_owned(leaf, tuple(map(_reduce_shards.this_device, _owned(leaf))))
        if lr is not None:
            # the reference's decay switch keeps the memory even with --zero-memory
            low_now = jnp.where(lr_drop, LOW_COMPRESSION, leaf.mode)
            leaf = switch(config, protocols, leaf, low_now, g, num, False)
        down = _regime.interval_scale(config.detector.interval_steps)
        accum = leaf.accum.value + g[None].astype(leaf.accum.value.dtype) * down
        leaf = leaf._replace(accum=_protocol.PerWorker(accum))
        keys[i] = jax.random.fold_in(key, i)
        mean = None
        if not sharded:
            mean, leaf = reduce_leaf(config, protocols, g, leaf, keys[i])
        if axis_name is not None:
            b_low = protocols[LOW_COMPRESSION].wire_bytes(g, num)
            b_high = protocols[HIGH_COMPRESSION].wire_bytes(g, num)
            sent += jnp.where(leaf.mode == LOW_COMPRESSION, b_low, b_high).astype(jnp.float32)
        means.append(mean)
        new_leaves.append(leaf)
        detect.append(i)
        protocols_of[i] = protocols

    if sharded:  # each parameter reduced over the slow axis by its owner on the fast one

        def reduce_one(i, g, part):
            if i not in protocols_of:
                return _protocol.pmean(g, axis_name), part
            leaf = _with_owned(new_leaves[i], part)
            mean, leaf = reduce_leaf(config, protocols_of[i], g, leaf, keys[i])
            return mean, _owned(leaf)

        parts = [_owned(new_leaves[i]) if i in protocols_of else () for i in range(len(flat))]
        pair = (axis_name, config.fast_axis)
        means, parts = _reduce_shards.reduce_owned(reduce_one, flat, parts, pair)
        for i in protocols_of:
            new_leaves[i] = _with_owned(new_leaves[i], parts[i])
        fast_sent += _reduce_shards.gathered_bytes(flat, _protocol.axis_size(config.fast_axis))

    position = _regime.position(config.detector, count)
    end = position[1]
    if detect:
        accums = [new_leaves[i].accum.value for i in detect]

        def statistics(accums):  # the replicated regime statistic (one tiny all-reduce)
            norms = jnp.stack([_regime.local_norm(a) for a in accums])
            return _regime.replicated_norms(norms, axis_name, config.detector.statistic)

        def no_statistics(accums):  # typed as statistics(): invariant over axis_name, varying
            # over the other mesh axes the accumulators vary over (e.g. a pipeline's stage)
            axes = set().union(*(_local.varying_axes(a) for a in accums)) - {axis_name}
            zeros = jnp.zeros((len(detect),), jnp.float32)
            return _local.to_varying(zeros, tuple(sorted(axes))) if axes else zeros

        # only the small statistic crosses the cond: no param-sized buffer is copied
        stats = lax.cond(end, statistics, no_statistics, accums)
        for j, i in enumerate(detect):
            new_leaves[i] = end_of_interval(
                config, protocols_of[i], new_leaves[i], stats[j], flat[i], position, num
            )
        if axis_name is not None:
            sent += jnp.where(end, 4.0 * len(detect), 0.0)
    if sharded:
        pair = (axis_name, config.fast_axis)
        for i in protocols_of:
            owned = [_reduce_shards.per_device(p, pair) for p in _owned(new_leaves[i])]
            new_leaves[i] = _with_owned(new_leaves[i], tuple(owned))
    new_state = AccordionState(
        count=optax.safe_increment(count),
        key=state.key,
        last_lr=state.last_lr if lr is None else lr,
        bytes_sent=sent,
        leaves=treedef.unflatten(new_leaves),
        fast_bytes_sent=fast_sent,
    )
    return treedef.unflatten(means), new_state
