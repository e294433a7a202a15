"""A study with a network axis: every cell at every (rate, hosts), each run in the lab.

The study's grid gains an axis ``network`` whose values name a rate and a host count
(``100mbit-2h``); a cell runs its config (the study's ``CONFIG`` file with the cell's
overrides as ``--set``) as ``hosts`` processes of ``mesh size / hosts`` devices on links of
that rate, through :func:`jaxcomp.study.run_study` (so a rerun continues, and failed cells are
recorded). Each network is calibrated once, on first use, and the calibration kept in
``WORKDIR/calibrations/`` and stored with every cell's ``lab.json``; the study report then
holds the network table and plots (:mod:`jaxcomp.study._network`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp.lab import _calibrate
from jaxcomp.lab import _lab
from jaxcomp.lab import _net
from jaxcomp.lab import _train
from jaxcomp.study import _grid
from jaxcomp.study import _runner
from jaxcomp.train._config import fingerprint

AXIS = "network"


def network_axis(rates: Sequence, hosts: Sequence[int]) -> dict[str, tuple[float | None, int]]:
    """``{"100mbit-2h": (1e8, 2), ...}``: every rate at every host count, unlimited first (the
    compute reference of the predictions) whether asked for or not.

    Example:
      >>> list(network_axis(["100mbit"], [2]))
      ['unlimited-2h', '100mbit-2h']
    """
    parsed = [r if r is None or isinstance(r, float) else _net.parse_rate(r) for r in rates]
    ordered = [None] + [r for r in dict.fromkeys(parsed) if r is not None]
    return {f"{_net.rate_name(r)}-{h}h": (r, int(h)) for h in hosts for r in ordered}


def _config_file(study: _grid.Study) -> str:
    name, colon, arg = study.config.partition(":")
    path = _grid._find(name, _grid.repo_configs_dir(), "config")
    return f"{path}{colon}{arg}"


def _sets(overrides: Mapping[str, Any]) -> list[str]:
    return [f"{k}={v!r}" for k, v in overrides.items()]


def run(
    study: _grid.Study,
    workdir: str,
    *,
    rates: Sequence = ("unlimited",),
    hosts: Sequence[int] = (2,),
    topology: str = "per_host",
    smoke: bool = False,
    extra: Mapping[str, Any] | None = None,
    only: Sequence[str] = (),
    targets: Sequence[float] = (),
    timeout_s: float = 1800.0,
    log=print,
) -> dict[str, str]:
    """Runs ``study`` at every point of its network axis in the lab (module docstring).

    Args:
      study: a loaded study.
      workdir: the study's folder.
      rates: link rates (``"100mbit"`` ...); unlimited is always added.
      hosts: host counts; each must divide the config's mesh size.
      topology: ``"per_host"`` or ``"shared"``.
      smoke, extra, only: as :func:`jaxcomp.study.run_study`.
      targets: test accuracies whose time to reach each cell reports.
      timeout_s: each cell's limit.
      log: where progress lines go.

    Returns:
      ``{cell name: status}``.
    """
    nets = network_axis(rates, hosts)
    if AXIS in study.axes:
        raise ValueError(f"study {study.name} already has an axis named {AXIS!r}.")
    study = study._replace(axes={**study.axes, AXIS: {name: {} for name in nets}})
    extra = dict(extra or {})
    grid = {c.name: c for c in _grid.cells(study, {**extra, **(_grid.SMOKE if smoke else {})})}
    config_file = _config_file(study)
    cal_dir = os.path.join(workdir, "calibrations")

    def calibration(lab: _lab.Lab) -> dict:
        d = lab.describe()
        path = os.path.join(cal_dir, f"{d['topology']}-{d['hosts']}x{d['devices_per_host']}-"
                                     f"{d['rate']}.json")  # fmt: skip
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        log(f"  calibrating {os.path.basename(path)[:-5]}")
        cal = _calibrate.calibrate(lab, path[:-5])
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
        return cal

    def train_fn(config, cell_dir):
        cell = grid[os.path.basename(cell_dir)]
        rate, n_hosts = nets[dict(cell.axes)[AXIS]]
        size = 1
        for _, n in config.mesh:
            size *= int(n)
        if size % n_hosts:
            raise ValueError(f"the mesh's {size} devices do not split over {n_hosts} hosts.")
        sets = _sets(cell.overrides)
        if fingerprint(_train.resolve_config(config_file, sets)) != fingerprint(config):
            raise ValueError(
                f"cell {cell.name}: {config_file} with --set {sets} is not the cell's config "
                "(an override that does not survive as text?)."
            )
        with _lab.Lab(n_hosts, rate, topology, size // n_hosts) as lab:
            cal = calibration(lab) if n_hosts > 1 else None
            _train.run_config(lab, config_file, cell_dir, overrides=sets, calibration=cal,
                              targets=targets, timeout_s=timeout_s, name=cell.name,
                              variant=cell.variant, axes=dict(cell.axes))  # fmt: skip

    os.makedirs(cal_dir, exist_ok=True)
    return _runner.run_study(study, workdir, smoke=smoke, extra=extra, only=only,
                             train_fn=train_fn, log=log)  # fmt: skip
