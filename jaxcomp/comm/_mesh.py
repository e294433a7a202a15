"""Mesh axis names and mesh construction.

Every module refers to mesh axes through these constants; permutations are derived from
``lax.axis_size`` inside ``shard_map``, never from a configured number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils

STAGE = "stage"  #: pipeline stages
DATA = "data"  #: data-parallel replicas
GROUP = "group"  #: AB-Training: independent worker groups
MEMBER = "member"  #: AB-Training: workers inside a group


def make_mesh(
    axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """Builds a mesh from ``[(name, size), ...]``; one size may be ``-1``.

    Its axes are ``AxisType.Auto`` (``jax.sharding.Mesh``'s default, not ``jax.make_mesh``'s
    Explicit): ``shard_map`` accepts inputs of any placement and XLA reshards them. On several
    hosts the first axis spans the hosts (the slow links) and the last stays inside one: with
    the default devices, a mesh of all of them whose first axis is a multiple of the number of
    TPU slices (several slices) or else of processes is laid out by
    ``mesh_utils.create_hybrid_device_mesh`` (each slice's or process's devices form one block
    of the first axis, in the accelerator's topology order inside it); otherwise (one host,
    explicit ``devices``, a smaller mesh) devices are taken in order.

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
    given = devices
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
    grid = device_grid(devices, sizes) if given is None else None
    if grid is None:
        grid = np.asarray(devices[:total], dtype=object).reshape(sizes)
    return jax.sharding.Mesh(grid, tuple(names))


def device_grid(devices: Sequence[Any], sizes: Sequence[int]) -> np.ndarray | None:
    """The hybrid layout of ``devices`` (all of them) as ``sizes``, the first axis across TPU
    slices or else processes (``mesh_utils.create_hybrid_device_mesh``); ``None`` where there
    is one granule, the first axis is not a multiple of their number, or they differ in size
    (the caller then takes the devices in order)."""
    if math.prod(sizes) != len(devices) or not sizes:
        return None
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_slice = len(slices) > 1 and None not in slices
    granules = len(slices) if by_slice else len({d.process_index for d in devices})
    if granules == 1 or sizes[0] % granules:
        return None
    dcn = [granules] + [1] * (len(sizes) - 1)
    ici = [sizes[0] // granules, *sizes[1:]]
    try:
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not by_slice
        )
    except ValueError:  # granules of different sizes
        return None
