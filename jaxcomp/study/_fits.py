r"""A lab calibration's fits as the cost model prices them (:mod:`jaxcomp.lab._calibrate`).

A calibration (``lab calibrate``) holds per collective kind an :math:`\alpha` (seconds per
message) and a :math:`\beta` (bytes per second) fitted on the lab's links: the all-reduce's on
a ring over every device-rank, the ping-pong's (``collective-permute``) with the links' token
bucket (``burst_bytes``), and on 3 hosts or more the chain fit (a send whose receiver also
sends in the same permute starts late). This module turns them into the cost model's links
(:class:`jaxcomp.study._cost.NetworkLink`) and prices collectives on them; the data-parallel
placement is :mod:`jaxcomp.study._dp_model`, the pipeline's play
:mod:`jaxcomp.study._pipeline_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

from jaxcomp.study import _cost

#: kinds priced with the ping-pong's fit; every other kind with the all-reduce's (ring hops)
POINT_TO_POINT = ("collective-permute",)


def links(fits: Mapping[str, Mapping[str, float]]) -> dict[str, _cost.NetworkLink]:
    """``{kind: NetworkLink}`` of a calibration's fits (``{"all-reduce": {"alpha_s",
    "beta_bytes_s"}, ...}``)."""
    return {
        k: _cost.NetworkLink(float(f["beta_bytes_s"]), float(f["alpha_s"])) for k, f in fits.items()
    }


def communication_s(colls: Sequence[_cost.Collective], fits: Mapping[str, Mapping]) -> float:
    """The cost model's seconds of a step's collectives on calibrated links: point-to-point
    kinds on the ping-pong's fit (the all-reduce's if there is none), the rest on the
    all-reduce's.

    Example:
      >>> fits = {"all-reduce": {"alpha_s": 1e-4, "beta_bytes_s": 1e7}}
      >>> round(communication_s([_cost.Collective("all-reduce", 1e5, 2)], fits), 6)
      0.0102
    """
    lk = links(fits)
    ring = lk["all-reduce"]
    total = 0.0
    for c in colls:
        link = lk.get(c.kind, ring) if c.kind in POINT_TO_POINT else ring
        total += _cost.communication_time([c], link)
    return total


def chain_delay_s(chain_fit: Mapping[str, float] | None, nbytes: float) -> float:
    """The seconds a send of ``nbytes`` starts late when its receiver also sends ``nbytes``
    in the same permute, by a calibration's chain fit (:func:`jaxcomp.lab._calibrate.chain`:
    ``min(max(n - offset, 0), cap) / beta``); 0 without one (a calibration made before the
    chain probe keeps the prediction it gave).

    Example:
      >>> f = {"offset_bytes": 4e3, "cap_bytes": 5e4, "beta_bytes_s": 1e6}
      >>> [round(chain_delay_s(f, n), 6) for n in (1e3, 3.2e4, 1e6)], chain_delay_s(None, 1e6)
      ([0.0, 0.028, 0.05], 0.0)
    """
    if not chain_fit:
        return 0.0
    ahead = min(max(nbytes - chain_fit["offset_bytes"], 0.0), chain_fit["cap_bytes"])
    return ahead / chain_fit["beta_bytes_s"]
