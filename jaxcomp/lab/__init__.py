"""The network lab: real multi-host runs over a rate-limited network built on one machine.

N ``jax.distributed`` CPU processes ("hosts", each with D fake devices, gloo collectives) run
inside Linux network namespaces joined by links limited to a chosen rate (JAX-NOTES §10): a
NIC per host into a switch (``"per_host"``), or one shared loopback (``"shared"``). The lab
calibrates the cost model's alpha and beta on its own links, runs trainer configs, studies with
a network axis, or any script there, records step times, time to accuracy and the cost model's
prediction beside them, and tears everything down. ``python -m jaxcomp.lab --help``.

* The network: :class:`Lab` (a context manager), :class:`NetworkSpec`, :func:`parse_rate`,
  :func:`rate_name`, :data:`TOPOLOGIES`, :func:`cleanup`, :class:`LabError`,
  :class:`LabTimeout`.
* Calibration: :func:`calibrate`, :func:`measure_rate`, :func:`fit_alpha_beta`.
* Runs: :func:`run_config` (a trainer config), :func:`run_network_study` (a study at every
  rate x hosts), :func:`write_network_report`.

The lab sits above ``train``, ``study`` and ``bench``; nothing below imports it. It needs root
or unprivileged user namespaces (the command line enters one when not root), and iproute2's
``ip`` and ``tc`` with the ``tbf`` qdisc.
"""

from jaxcomp.lab._calibrate import calibrate
from jaxcomp.lab._calibrate import fit as fit_alpha_beta
from jaxcomp.lab._calibrate import measure_rate
from jaxcomp.lab._hosts import HostsResult
from jaxcomp.lab._hosts import Stopped
from jaxcomp.lab._lab import Lab
from jaxcomp.lab._net import TOPOLOGIES
from jaxcomp.lab._net import LabError
from jaxcomp.lab._net import LabTimeout
from jaxcomp.lab._net import NetworkSpec
from jaxcomp.lab._net import cleanup
from jaxcomp.lab._net import parse_rate
from jaxcomp.lab._net import rate_name
from jaxcomp.lab._report import write as write_network_report
from jaxcomp.lab._study import run as run_network_study
from jaxcomp.lab._train import run_config

__all__ = (
    "TOPOLOGIES",
    "HostsResult",
    "Lab",
    "LabError",
    "LabTimeout",
    "NetworkSpec",
    "Stopped",
    "calibrate",
    "cleanup",
    "fit_alpha_beta",
    "measure_rate",
    "parse_rate",
    "rate_name",
    "run_config",
    "run_network_study",
    "write_network_report",
)
