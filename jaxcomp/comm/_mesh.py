"""Mesh axis names and mesh construction.

Every module refers to mesh axes through these constants; permutations are derived from
``lax.axis_size`` inside ``shard_map``, never from a configured number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

STAGE = "stage"  #: pipeline stages
DATA = "data"  #: data-parallel replicas
GROUP = "group"  #: AB-Training: independent worker groups
MEMBER = "member"  #: AB-Training: workers inside a group


def make_mesh(
    axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """Builds a mesh from ``[(name, size), ...]``; one size may be ``-1``.

    Its axes are ``AxisType.Auto`` (``jax.sharding.Mesh``'s default, not ``jax.make_mesh``'s
    Explicit): ``shard_map`` accepts inputs of any placement and XLA reshards them. Devices are
    taken in ``jax.devices()`` order, process by process, so on several hosts the first axis
    spans the hosts (the slow links) and the last stays inside one.

    Args:
      axes: axis names and sizes, outermost first; ``-1`` fills with the remaining devices.
      devices: devices to use (default: all of ``jax.devices()``). Only the first
        ``prod(sizes)`` are used.

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      ValueError: naming the problem if the devices cannot form the mesh.

    Example:
      >>> from jaxcomp import comm
      >>> mesh = comm.make_mesh([("stage", 4)], devices=jax.devices()[:4])  # doctest: +SKIP
    """
    devices = list(jax.devices() if devices is None else devices)
    names = [a[0] for a in axes]
    sizes = [int(a[1]) for a in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must be distinct; got {names}.")
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive, with at most one -1; got {sizes}.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"cannot fill mesh {dict(zip(names, sizes))}: {len(devices)} devices are not a "
                f"multiple of {known}."
            )
        sizes[sizes.index(-1)] = len(devices) // known
    total = math.prod(sizes)
    if total > len(devices):
        raise ValueError(
            f"mesh {dict(zip(names, sizes))} needs {total} devices; only {len(devices)} available."
        )
    grid = np.asarray(devices[:total], dtype=object).reshape(sizes)
    return jax.sharding.Mesh(grid, tuple(names))
