r"""The data-parallel cost model on the lab's hosts: which collectives of a step reach the link.

A run's collectives (``summary.json``'s ``collectives``, as the study report reads them) are
placed by their group (:func:`nic_share`): on a hierarchical mesh (``[("slow", hosts),
("fast", devices)]``) one inside a host never reaches the link (its time is in the compute),
one over the slow axis runs as ``D`` concurrent rings of ``W`` ranks (one per device of a
host), all through the host's NIC: :math:`2 (W - 1) \alpha + 2 \frac{W - 1}{W} D n / \beta`;
one over the whole mesh is the calibrated ring (:mod:`jaxcomp.study._fits`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp.study import _report

#: kinds whose group is a set of mesh axes (placed by :func:`nic_share`); permutes keep theirs
GROUP_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def nic_share(group_size: int, mesh: Sequence, hosts: int, devices_per_host: int) -> int | None:
    """How many of a collective's groups send through one host's NIC at once: 0 for a group
    inside a host (it never reaches the link), ``devices_per_host`` for a group over the axes
    between hosts only (each device of a host is in its own group), 1 for the whole mesh (the
    calibrated ring); ``None`` where the group size does not say which axes it spans.

    The devices are laid out host-major (:func:`jaxcomp.comm.make_mesh`): the trailing axes whose
    sizes multiply to ``devices_per_host`` lie inside a host, the leading ones between hosts. A
    mesh with no such split (one ``data`` axis over every device) or one device per host puts
    every collective on the calibrated ring (share 1), as the calibration measured it.

    Example:
      >>> mesh = [("slow", 2), ("fast", 4)]
      >>> [nic_share(g, mesh, 2, 4) for g in (4, 2, 8)]
      [0, 4, 1]
      >>> nic_share(8, [("data", 8)], 2, 4)
      1
    """
    sizes = [int(n) for _, n in mesh]
    total = math.prod(sizes)
    inner, split = 1, len(sizes)
    while split > 0 and inner < devices_per_host:
        split -= 1
        inner *= sizes[split]
    if devices_per_host == 1 or inner != devices_per_host or split == 0:
        return 1
    if group_size == total:
        return 1
    shares = set()
    for mask in range(1, 1 << len(sizes)):
        axes = [i for i in range(len(sizes)) if mask >> i & 1]
        if math.prod(sizes[i] for i in axes) != group_size:
            continue
        if all(i >= split for i in axes):
            shares.add(0)
        elif all(i < split for i in axes):
            shares.add(devices_per_host)
        else:
            shares.add(None)  # partly inside, partly between hosts: not modelled
    return shares.pop() if len(shares) == 1 else None


def collectives(
    workdir: str, network: Mapping[str, Any] | None = None
) -> tuple[list[dict[str, Any]] | None, str]:
    """The collectives of the run's mean step, as the study report prices them
    (:func:`jaxcomp.study._report.collectives_of`), each a ``Collective``'s fields with
    ``"per_nic"`` (:func:`nic_share` on the lab's ``network``; 1 without one).

    On a hierarchical mesh the run's mean ``wire_bytes_per_step`` counts the slow axis only, so
    collectives in branches are scaled against the bytes of those that cross the link. A run
    whose mean is sharded over the fast axis (summary ``shard_fast``) runs each branched slow
    collective on one device of a host (the parameters' owner): one group through the NIC, not
    ``devices_per_host``; their latencies are summed, an upper bound where the owners' branches
    overlap.
    """
    summary = _report._load_json(os.path.join(workdir, "summary.json"), {})
    experiment = _report._load_json(os.path.join(workdir, "experiment.json"), {})
    recs, mesh = summary.get("collectives"), experiment.get("mesh")
    if network and isinstance(recs, list) and mesh:
        hosts, per_host = int(network["hosts"]), int(network["devices_per_host"])
        try:
            shares = [
                nic_share(int(r["group_size"]), mesh, hosts, per_host)
                if r["kind"] in GROUP_KINDS
                else 1
                for r in recs
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"summary.json collectives are damaged ({e!r}).") from e
        if summary.get("shard_fast"):
            shares = [
                1 if x == per_host and r.get("conditional") else x for r, x in zip(recs, shares)
            ]
        if None in shares:
            return None, (
                f"a collective's group size does not say which axes of the mesh {mesh} it "
                f"spans on {hosts} host(s) x {per_host} device(s)"
            )
        if any(x != 1 for x in shares):
            crossing = [(r, x) for r, x in zip(recs, shares) if x]
            colls, how = _report._measured(
                [r for r, _ in crossing], summary.get("wire_bytes_per_step")
            )
            if colls is None:
                return None, how
            fields = ("kind", "bytes_per_execution", "group_size", "executions")
            out = [c._asdict() | {"per_nic": x} for c, (_, x) in zip(colls, crossing)]
            out += [{k: r[k] for k in fields} | {"per_nic": 0}
                    for r, x in zip(recs, shares) if not x]  # fmt: skip
            return out, how + "; those inside a host off the link"
    run = _report.Run(os.path.basename(workdir), "", {}, 0, "done", summary, [], [], experiment)
    colls, how = _report.collectives_of(run)
    return (None if colls is None else [c._asdict() | {"per_nic": 1} for c in colls]), how
