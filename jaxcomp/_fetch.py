"""Host copies of global arrays, correct in a single process and across ``jax.distributed``
processes.

``np.asarray(x)`` (and ``jax.device_get``, ``float(x)``, ``int(x)``) of a ``jax.Array`` whose
shards live partly on another process's devices raises ("Fetching value for `jax.Array` that
spans non-addressable devices is not possible"), and ``x.addressable_data(0)`` gives this
process's first shard, which is the whole value only when ``x`` is replicated: silently wrong
for a per-worker ``[N]`` metric sharded over the workers. :func:`fetch` gives the whole value
of every leaf on every process: from local memory when this process holds it (a replicated
array, or one whose shards are all on local devices), else by one all-gather program over
the leaves that need it, which every process must run (each calls :func:`fetch` at the same
point of the same host program, as SPMD host code does).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def is_local(x: Any) -> bool:
    """Whether this process holds the whole value of ``x`` (a host value, a replicated array
    or one whose every shard is on this process's devices)."""
    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable or x.is_fully_replicated


def _replicated(x: jax.Array) -> NamedSharding:
    """``x``'s devices, each holding the whole value."""
    if isinstance(x.sharding, NamedSharding):
        return x.sharding.update(spec=P())
    devices = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
    return NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("all",)), P())


def _identity(tree: Any) -> Any:
    return tree


@functools.lru_cache(maxsize=64)
def _gather(shardings: tuple[NamedSharding, ...]) -> Any:
    """The jitted program replicating leaves onto ``shardings`` (one per output layout, so
    that each call after the first takes JAX's fast path)."""
    return jax.jit(_identity, out_shardings=list(shardings))


def fetch(tree: Any) -> Any:
    """``tree`` with every ``jax.Array`` leaf as a host ``np.ndarray`` of its whole value.

    Leaves held here are copied in one ``jax.device_get``; the others (sharded across
    processes) are first replicated by one jitted program (an all-gather per leaf; XLA may
    combine them), which every process runs. Host leaves pass through ``np.asarray``.

    Args:
      tree: a pytree of arrays (``jax.Array``, numpy, Python scalars).

    Returns:
      The same structure of ``np.ndarray``.

    Example:
      >>> flags = fetch(metrics["finite"])  # doctest: +SKIP
      >>> bool(flags.min())  # doctest: +SKIP
    """
    leaves, treedef = jax.tree.flatten(tree)
    remote = [i for i, x in enumerate(leaves) if not is_local(x)]
    if remote:
        gather = _gather(tuple(_replicated(leaves[i]) for i in remote))
        for i, x in zip(remote, gather([leaves[i] for i in remote])):
            leaves[i] = x.addressable_data(0)
    local = [x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable
             else x for x in leaves]  # fmt: skip
    return jax.tree.unflatten(treedef, [np.asarray(h) for h in jax.device_get(local)])
