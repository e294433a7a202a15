"""A hierarchical mean's reductions between hosts, shared out over the devices of each host.

On a ``(slow, fast)`` mesh the dense mean over ``fast`` leaves every device of a fast group (a
host) holding the same values. If each then ran every parameter's compressed reduction over
``slow``, the slow links would carry the payload ``W_fast`` times per host and every device
would compute the whole compression. Here each parameter gets one **owner** among the fast
devices (:func:`owners`: sizes balanced, largest first); a device runs the reductions over
``slow`` of the parameters it owns only (its slow group, the devices of the same fast index on
the other hosts, owns the same ones), and one ``all_gather`` over ``fast`` of the owners' means
gives every device all of them:

.. math::
  \\bar g_i = \\mathrm{gather}_{fast}\\big(\\mathrm{reduce}_{slow}(g_i)
  \\text{ on the device } f = o(i)\\big), \\qquad o(i) \\in \\{0, \\dots, W_{fast} - 1\\}

So the slow link carries each payload once per host, and a device computes about
``1 / W_fast`` of the compression. The device's branch is a ``lax.switch`` on its fast index,
which is uniform over ``slow`` (every collective over ``slow`` in it is run by all of its
group).

**State.** What a reduction keeps (error feedback, PowerSGD's ``Q``, codec states) is kept by
the owner only: the state of every parameter is :class:`~jaxcomp.comm.PerDevice` (a copy per
device, placed ``[W_slow, W_fast, ...]`` over both axes), updated on its owner and passed
through unchanged elsewhere, where it is never read. The owners are a function of the
parameters' shapes and ``W_fast``, and a state placed on another split of the devices has other
shapes (:func:`jaxcomp.comm.place_state` refuses it).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _vma
from jaxcomp.comm._placement import PerDevice
from jaxcomp.compressors import _protocol


def owners(likes: Sequence[Any], num: int) -> tuple[int, ...]:
    """The fast device that reduces each array: largest first, each to the least loaded device
    so far (ties to the lower index), loads counted in bytes.

    Args:
      likes: the arrays (or ``ShapeDtypeStruct``s), in the tree's order.
      num: ``W_fast``, the devices to share them among.

    Returns:
      ``owner[i]`` in ``range(num)`` for every array (deterministic in the shapes and dtypes).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> likes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(64, 256), (256,), (256, 256)]]
      >>> owners(likes, 2)
      (1, 1, 0)
    """
    sizes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in likes]
    load = [0] * num
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(num), key=lambda f: (load[f], f))
        out[i] = f
        load[f] += sizes[i]
    return tuple(out)


def init_per_device(tree: Any) -> PerDevice:
    """``tree`` as one device's part: every leaf with leading axes ``[1, 1]`` (outside
    ``shard_map``; :func:`jaxcomp.comm.place_state` stacks them over the pair)."""
    return PerDevice(jax.tree.map(lambda x: jnp.asarray(x)[None, None], tree))


def this_device(part: PerDevice) -> Any:
    """This device's tree inside a :class:`~jaxcomp.comm.PerDevice` (drops ``[1, 1]``)."""
    if not isinstance(part, PerDevice):
        raise TypeError(
            f"expected a PerDevice state part (a mean sharded over the fast axis); got "
            f"{type(part).__name__}: a state from an unsharded mean, or from another split."
        )
    for leaf in jax.tree.leaves(part.value):
        if leaf.shape[:2] != (1, 1):
            raise ValueError(
                f"a per-device state leaf of shape {tuple(leaf.shape)} reached a sharded mean "
                "without its leading axes [1, 1]: place the state with jaxcomp.comm.place_state "
                "on the (slow, fast) pair and give shard_map its state_specs (P(slow, fast))."
            )
    return jax.tree.map(lambda leaf: leaf[0, 0], part.value)


def per_device(tree: Any, axes: tuple[str, str]) -> PerDevice:
    """This device's new ``tree`` as a :class:`~jaxcomp.comm.PerDevice` (varying over both
    axes of the pair)."""
    tree = _vma.to_varying(tree, axes)
    return PerDevice(jax.tree.map(lambda x: x[None, None], tree))


def _layout(likes, owner, num):
    """Per dtype: the segment length and, per array of that dtype, ``(owner, offset)``."""
    used = collections.defaultdict(lambda: [0] * num)
    place = []
    for x, f in zip(likes, owner):
        dtype = np.dtype(x.dtype)
        place.append((dtype, f, used[dtype][f]))
        used[dtype][f] += math.prod(x.shape)
    return {d: max(n) for d, n in used.items()}, place


def gathered_bytes(likes: Sequence[Any], num: int) -> int:
    """Bytes one device puts into :func:`reduce_owned`'s ``all_gather`` over ``fast``."""
    lengths, _ = _layout(likes, owners(likes, num), num)
    return sum(n * d.itemsize for d, n in lengths.items())


def reduce_owned(
    reduce_one: Callable[[int, jax.Array, Any], tuple[jax.Array, Any]],
    xs: Sequence[jax.Array],
    states: Sequence[Any],
    axes: tuple[str, str],
) -> tuple[list[jax.Array], list[Any]]:
    """Runs ``reduce_one(i, xs[i], states[i])`` on the owner of array ``i`` only, inside
    ``shard_map`` over the pair ``axes = (slow, fast)``, and gathers the means over ``fast``.

    Args:
      reduce_one: ``(i, x, state) -> (mean, new_state)``, the reduction of array ``i`` over
        ``slow`` (its collectives over ``slow`` only); ``mean`` has ``x``'s shape and dtype.
      xs: the arrays, the same on every device of a fast group (after the mean over ``fast``).
      states: their states, as this device holds them (unwrapped, :func:`this_device`).
      axes: ``(slow, fast)``.

    Returns:
      ``(means, states)``: every array's mean (the owner's, bit for bit, on every device) and
      the states: the owner's new one for the arrays this device owns, the given one for the
      others.
    """
    slow, fast = axes
    num = _protocol.axis_size(fast)
    owner = owners(xs, num)
    lengths, place = _layout(xs, owner, num)
    both = tuple(sorted(set(axes)))
    # the axes other than the pair that the arrays vary over (a pipeline's stage): every
    # branch's segment is typed with them, whether it holds such an array or only padding
    other = set().union(*(_vma.varying_axes(x) for x in xs)) - set(axes)
    segment_axes = tuple(sorted(other | {fast}))

    def branch(f):
        def run(xs, states):
            states = list(states)
            parts = {d: [] for d in lengths}
            for i, x in enumerate(xs):
                if owner[i] == f:
                    mean, states[i] = reduce_one(i, x, states[i])
                    parts[place[i][0]].append(mean.reshape(-1))
            segments = []
            for d, n in lengths.items():
                flat = jnp.concatenate(parts[d]) if parts[d] else jnp.zeros((0,), d)
                segments.append(jnp.pad(flat, (0, n - flat.shape[0])))
            # every branch returns the same types: the segment varies over fast (each device
            # its own), the states over both axes (each device keeps its own)
            return _vma.to_varying(segments, segment_axes), _vma.to_varying(states, both)

        return run

    states = [_vma.to_varying(s, both) for s in states]
    segments, states = lax.switch(
        lax.axis_index(fast), [branch(f) for f in range(num)], list(xs), states
    )
    gathered = dict(zip(lengths, _protocol.all_gather(segments, fast)))  # d: [num, n]
    means = []
    for x, (d, f, offset) in zip(xs, place):
        size = math.prod(x.shape)
        means.append(gathered[d][f, offset : offset + size].reshape(x.shape))
    return means, states
