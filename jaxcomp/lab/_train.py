"""A trainer config run in the lab: ``python -m jaxcomp.main`` on every host, and what it
measured (``lab.json`` in the workdir, read by :mod:`jaxcomp.study._network`)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence

from jaxcomp.lab import _lab
from jaxcomp.lab import _net
from jaxcomp.study import _network

#: what identifies the network of a lab run (a workdir may only be continued on the same one)
NETWORK_KEYS = ("topology", "hosts", "devices_per_host", "rate_bit_s", "slow_start_after_idle")


def resolve_config(config: str, overrides: Sequence[str] = ()):
    """The full config ``python -m jaxcomp.main --config config --set ...`` would run.

    Raises:
      ValueError: naming the problem (missing file, bad override, unknown key).
    """
    from jaxcomp import main
    from jaxcomp import train

    return train.with_defaults(
        train.apply_overrides(main.load_config(config), train.parse_overrides(list(overrides)))
    )


def check_layout(cfg, hosts: int, devices: int) -> None:
    """A config's mesh must use every device of every host exactly.

    Raises:
      ValueError: naming the mesh and the lab's layout.
    """
    size = 1
    for _, n in cfg.mesh:
        size *= int(n)
    if size != hosts * devices:
        raise ValueError(
            f"config.mesh {list(map(tuple, cfg.mesh))} has {size} devices; the lab has {hosts} "
            f"host(s) x {devices} device(s) = {hosts * devices}: pass --devices {size // hosts}"
            if size % hosts == 0
            else f"config.mesh {list(map(tuple, cfg.mesh))} has {size} devices, not a multiple "
            f"of {hosts} host(s)."
        )


def _check_workdir(workdir: str, network: dict) -> None:
    path = os.path.join(workdir, _network.LAB_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)["network"]
        if any(old.get(k) != network.get(k) for k in NETWORK_KEYS):
            raise ValueError(
                f"{workdir!r} holds a lab run on another network ({old.get('rate')}, "
                f"{old.get('hosts')} x {old.get('devices_per_host')}, {old.get('topology')}): "
                "use a new workdir."
            )
    elif os.path.isfile(os.path.join(workdir, "summary.json")):
        raise ValueError(f"{workdir!r} holds a finished run made outside the lab: use a new one.")


def run_config(
    lab: _lab.Lab,
    config: str,
    workdir: str,
    *,
    overrides: Sequence[str] = (),
    calibration: dict | None = None,
    targets: Sequence[float] = (),
    loss_targets: Sequence[float] = (),
    timeout_s: float = 1800.0,
    name: str | None = None,
    variant: str | None = None,
    axes: dict | None = None,
) -> dict:
    """Trains ``config`` on every host of the open ``lab`` and records the run.

    Writes ``lab.json`` into ``workdir`` (the network, its calibration, the command, the
    machine's load before and after, the targets) beside the trainer's files, and the hosts'
    output into ``workdir/lab_logs/host<i>.log``.

    Args:
      lab: an open :class:`~jaxcomp.lab.Lab`.
      config: ``configs/NAME.py[:arg]``.
      workdir: the run's directory (new, or a run on the same network to continue).
      overrides: ``KEY=VALUE`` strings, as ``jaxcomp.main --set``.
      calibration: the lab's calibration of this network (stored with the result).
      targets: test accuracies whose time to reach is reported.
      loss_targets: validation losses whose time to reach (at or below) is reported.
      timeout_s: the run's wall-clock limit.
      name, variant, axes: how a study names the run.

    Returns:
      The run's record (:func:`jaxcomp.study._network.read_lab_run`).

    Raises:
      ValueError: a bad config or workdir. LabError: a host failed or the run timed out.
    """
    cfg = resolve_config(config, overrides)
    check_layout(cfg, lab.spec.hosts, lab.devices)
    network = lab.describe()
    _check_workdir(workdir, network)
    os.makedirs(workdir, exist_ok=True)
    argv = [sys.executable, "-m", "jaxcomp.main", "--config", config, "--workdir", workdir,
            "--cpu_devices", "{devices}"]  # fmt: skip
    for o in overrides:
        argv += ["--set", o]
    record = {
        "name": name or os.path.basename(os.path.abspath(workdir)),
        "variant": variant,
        "axes": axes or {},
        "config": config,
        "overrides": list(overrides),
        "command": shlex.join(argv),
        "network": network,
        "calibration": calibration,
        "targets": list(targets),
        "loss_targets": list(loss_targets),
        "checkpoint_every": int(cfg.checkpoint_every or 0),
        "eval_every": int(cfg.eval_every or 0),
        "load_before": _lab.load(),
    }
    result = lab.run(argv, os.path.join(workdir, "lab_logs"), timeout_s=timeout_s)
    record.update(
        load_after=_lab.load(),
        seconds=result.seconds,
        returncodes=list(result.returncodes),
        timed_out=result.timed_out,
    )
    path = os.path.join(workdir, _network.LAB_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    if not result.ok:
        how = "timed out" if result.timed_out else f"exited {list(result.returncodes)}"
        error = _net.LabTimeout if result.timed_out else _net.LabError
        raise error(f"the trainer {how} in the lab; see {list(result.logs)}")
    return _network.read_lab_run(workdir)
