r"""``python -m jaxcomp.lab``: runs configs, studies and scripts as several hosts on a real,
rate-limited network built on this machine.

  python -m jaxcomp.lab check
  python -m jaxcomp.lab rate --rate 50mbit
  python -m jaxcomp.lab calibrate --hosts 2 --devices 4 --rate 100mbit --out cal.json
  python -m jaxcomp.lab train --config configs/digits_dense.py --workdir runs/lab/dense \
      --hosts 2 --devices 4 --rate 100mbit [--set KEY=VALUE ...] [--calibration cal.json]
      [--target 0.97] [--target_loss 1.9]
  python -m jaxcomp.lab study accordion_powersgd --workdir runs/lab/acc \
      --rates 100mbit,1gbit --hosts 2 [--smoke] [--set ...] [--cells PATTERN ...]
  python -m jaxcomp.lab run --hosts 2 --devices 4 --rate 100mbit --log_dir D -- python x.py
  python -m jaxcomp.lab report runs/lab/dense runs/lab/acc ... [--out DIR]
  python -m jaxcomp.lab cleanup [--all]

Common options: ``--topology per_host|shared`` (a NIC per host into a switch, or one shared
loopback), ``--timeout`` seconds. ``run`` replaces ``{process_id}``, ``{num_processes}``,
``{coordinator}``, ``{devices}`` and ``{address}`` in the command, and sets
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

As root the lab makes named network namespaces (``ip netns``); as another user it first enters
a user namespace of its own (``unshare --user --map-root-user``; everything it makes there
dies with it). Where neither works it says so in one line and exits 2. Namespaces, links and
processes are removed on success, failure, Ctrl-C and SIGTERM; ``cleanup`` removes what a
lab killed by SIGKILL left (``--all``: also those of labs still running).

Exit codes: 0 done; 1 a host or cell failed; 2 a setup problem (one ``error:`` line); 124 the
timeout stopped the run; 128 + N stopped by signal N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from jaxcomp.lab import _hosts
from jaxcomp.lab import _net

EXIT_FAILED, EXIT_SETUP = 1, 2
USERNS_FLAG = "JAXCOMP_LAB_USERNS"


def _network_args(p: argparse.ArgumentParser, *, devices: bool = True, rate: bool = True):
    p.add_argument("--hosts", type=int, default=2, help="processes, one per host (default 2)")
    if devices:
        p.add_argument("--devices", type=int, default=1, help="fake CPU devices per host")
    if rate:
        p.add_argument("--rate", default="unlimited", help="10mbit ... 10gbit or unlimited")
    p.add_argument("--topology", default="per_host", choices=_net.TOPOLOGIES)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--no_slow_start_after_idle", action="store_true",
                   help="TCP keeps its window across idle gaps (lab namespaces only)")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.lab", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="can this machine build a lab? (one line)")
    rate = sub.add_parser("rate", help="the rate one TCP transfer achieves on a lab link")
    _network_args(rate, devices=False)
    rate.add_argument("--bytes", type=int, default=None)
    cal = sub.add_parser("calibrate", help="measure the network, fit alpha and beta")
    _network_args(cal)
    cal.add_argument("--out", required=True, help="the calibration's JSON")
    tr = sub.add_parser("train", help="a trainer config as several hosts")
    _network_args(tr)
    tr.add_argument("--config", required=True)
    tr.add_argument("--workdir", required=True)
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    tr.add_argument("--calibration", default=None,
                    help="a calibration JSON of this network to store with the result "
                    "(default: calibrate first; 'none': skip)")  # fmt: skip
    tr.add_argument("--target", type=float, action="append", default=[],
                    help="report the time to this test accuracy (repeatable)")  # fmt: skip
    tr.add_argument("--target_loss", type=float, action="append", default=[],
                    help="report the time to this validation loss or less")  # fmt: skip
    tr.add_argument("--variant", default=None,
                    help="a name for the run in reports (runs of one variant at several "
                    "rates share the unlimited one's compute)")  # fmt: skip
    st = sub.add_parser("study", help="a study at every rate x hosts, each cell in the lab")
    st.add_argument("study")
    st.add_argument("--workdir", required=True)
    st.add_argument("--rates", default="unlimited", help="comma-separated; unlimited is added")
    st.add_argument("--hosts", default="2", help="comma-separated host counts")
    st.add_argument("--topology", default="per_host", choices=_net.TOPOLOGIES)
    st.add_argument("--timeout", type=float, default=1800.0, help="seconds per cell")
    st.add_argument("--smoke", action="store_true")
    st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    st.add_argument("--cells", action="append", default=[], metavar="PATTERN")
    st.add_argument("--target", type=float, action="append", default=[])
    st.add_argument("--studies_dir", default=None)
    run = sub.add_parser("run", help="any command, once per host")
    _network_args(run)
    run.add_argument("--log_dir", required=True)
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    rep = sub.add_parser("report", help="table and plots of lab runs (trainer workdirs)")
    rep.add_argument("workdirs", nargs="+")
    rep.add_argument("--out", default=None, help="where to write report.md and the plots")
    clean = sub.add_parser("cleanup", help="remove what killed labs left behind")
    clean.add_argument("--all", action="store_true", help="also namespaces of running labs")
    args = p.parse_args(argv)
    if args.command == "run":
        args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not args.argv:
            p.error("run needs a command after --")
    return args


#: runs a command inside a user, network, mount and pid namespace of its own where it is root:
#: a private tmpfs on /run holds the lab's named namespaces, and when the command exits the
#: kernel kills whatever it left
USERNS_PREFIX = ("unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
                 "--kill-child", "--mount-proc", "--", "sh", "-c",
                 'mount -t tmpfs jxlab /run && mkdir -p /run/netns && exec "$@"', "sh")  # fmt: skip


def _userns_command(argv) -> list[str]:
    """This CLI again, inside :data:`USERNS_PREFIX`'s namespaces."""
    return [*USERNS_PREFIX, sys.executable, "-m", "jaxcomp.lab", *argv]


def _reexec_unprivileged(argv) -> int | None:
    """As a user other than root: runs the CLI in a user namespace; ``None`` when already root
    (or already inside)."""
    if os.geteuid() == 0:
        return None
    if os.environ.get(USERNS_FLAG) or shutil.which("unshare") is None:
        print("error: the network lab needs root or unprivileged user namespaces "
              "(unshare not found or not root inside).", file=sys.stderr)  # fmt: skip
        return EXIT_SETUP
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--mount", "true"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"error: the network lab needs root or unprivileged user namespaces; "
              f"`unshare --user --net` failed here: {why}", file=sys.stderr)  # fmt: skip
        return EXIT_SETUP
    env = {**os.environ, USERNS_FLAG: "1"}
    try:
        return subprocess.run(_userns_command(argv), env=env).returncode
    except KeyboardInterrupt:
        return 128 + 2


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def _lab(args):
    from jaxcomp.lab import _lab

    return _lab.Lab(args.hosts, args.rate, args.topology, getattr(args, "devices", 1),
                    slow_start_after_idle=not args.no_slow_start_after_idle)  # fmt: skip


def _rate(args) -> int:
    from jaxcomp.lab import _calibrate

    if args.hosts < 2:
        raise ValueError("--hosts must be >= 2 (a transfer needs two hosts).")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jxlab-rate-") as d, _lab(args) as lab:
        got = _calibrate.measure_rate(lab, d, args.bytes)
    print(f"{_net.rate_name(lab.spec.rate_bit_s)} ({args.topology}): {got['bytes']} bytes in "
          f"{got['seconds']:.3f} s = {got['bit_s'] / 1e6:.1f} Mbit/s of payload")  # fmt: skip
    return 0


def _calibrate_cmd(args) -> int:
    from jaxcomp.lab import _calibrate

    out_dir = os.path.splitext(args.out)[0]
    with _lab(args) as lab:
        cal = _calibrate.calibrate(lab, out_dir, timeout_s=args.timeout)
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
    _print_calibration(cal)
    return 0


def _print_calibration(cal: dict) -> None:
    net = cal["network"]
    print(f"{net['rate']} ({net['topology']}, {net['hosts']} x {net['devices_per_host']}): "
          f"achieved {cal['achieved']['bit_s'] / 1e6:.1f} Mbit/s")  # fmt: skip
    for kind, f in cal["fits"].items():
        print(
            f"  {kind}/{f['group_size']}: alpha {1e6 * f['alpha_s']:.0f} us, beta "
            f"{f['beta_bit_s'] / 1e6:.1f} Mbit/s (max error {100 * f['max_rel_error']:.0f}%)"
        )


def _train_cmd(args) -> int:
    from jaxcomp.lab import _calibrate
    from jaxcomp.lab import _train

    _train.check_layout(_train.resolve_config(args.config, args.set), args.hosts, args.devices)
    cal = None
    if args.calibration not in (None, "none"):
        cal = _load_json(args.calibration)
    with _lab(args) as lab:
        if cal is not None:
            mine, theirs = lab.describe(), cal.get("network", {})
            if any(mine.get(k) != theirs.get(k) for k in _train.NETWORK_KEYS):
                raise ValueError(f"--calibration {args.calibration} is of another network "
                                 f"({theirs.get('rate')}, {theirs.get('hosts')} x "
                                 f"{theirs.get('devices_per_host')}).")  # fmt: skip
        elif args.calibration is None and args.hosts > 1:
            cal = _calibrate.calibrate(lab, os.path.join(args.workdir, "calibration"))
            _print_calibration(cal)
        record = _train.run_config(lab, args.config, args.workdir, overrides=args.set,
                                   calibration=cal, targets=args.target,
                                   loss_targets=args.target_loss, timeout_s=args.timeout,
                                   variant=args.variant)  # fmt: skip
    st = record["measured"]["step_time"] or {}
    if st:
        print(f"step time: median {1e3 * st['median_s']:.1f} ms [q25 {1e3 * st['q25_s']:.1f}, "
              f"q75 {1e3 * st['q75_s']:.1f}] over {st['n']} steps")  # fmt: skip
    hits = list(record["measured"]["time_to_accuracy"].items())
    hits += [(f"loss {k}", v) for k, v in record["measured"]["time_to_loss"].items()]
    for target, hit in hits:
        print(
            f"time to {target}: "
            + (
                f"{hit['train_s']:.1f} s of training (step "
                f"{hit['step']}), {hit['elapsed_s']:.1f} s since start"
                if hit
                else "not reached"
            )
        )
    return 0


def _study_cmd(args) -> int:
    from jaxcomp import train
    from jaxcomp.lab import _study
    from jaxcomp.study import _grid
    from jaxcomp.study import _write

    study = _grid.load_study(args.study, args.studies_dir)
    hosts = [int(h) for h in args.hosts.split(",") if h]
    statuses = _study.run(study, args.workdir, rates=args.rates.split(","), hosts=hosts,
                          topology=args.topology, smoke=args.smoke,
                          extra=train.parse_overrides(args.set), only=args.cells,
                          targets=args.target, timeout_s=args.timeout)  # fmt: skip
    print(f"report: {_write.write_report(args.workdir)['markdown']}")
    failed = sorted(k for k, v in statuses.items() if v == "failed")
    if failed:
        print(f"error: {len(failed)} cell(s) failed: {failed[:5]}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _run_cmd(args) -> int:
    with _lab(args) as lab:
        result = lab.run(args.argv, args.log_dir, timeout_s=args.timeout)
    print(f"hosts exited {list(result.returncodes)} after {result.seconds:.1f} s; logs in "
          f"{args.log_dir}")  # fmt: skip
    if result.timed_out:
        return _hosts.EXIT_TIMEOUT
    return 0 if result.ok else EXIT_FAILED


def _report_cmd(args) -> int:
    from jaxcomp.lab import _report

    path = _report.write(args.workdirs, args.out or ".")
    print(f"report: {path}")
    return 0


def _cleanup_cmd(args) -> int:
    if os.environ.get(USERNS_FLAG):
        print("nothing to clean: a lab run as another user than root leaves nothing behind.")
        return 0
    removed = _net.cleanup(everything=args.all)
    print(f"removed {len(removed)} namespace(s)" + (f": {removed}" if removed else ""))
    return 0


COMMANDS = {"rate": _rate, "calibrate": _calibrate_cmd, "train": _train_cmd,
            "study": _study_cmd, "run": _run_cmd, "report": _report_cmd,
            "cleanup": _cleanup_cmd}  # fmt: skip


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.command != "report":
        code = _reexec_unprivileged(argv)
        if code is not None:
            return code
    try:
        if args.command == "check":
            from jaxcomp.lab import _lab

            with _lab.Lab(2, "10mbit"):  # a real network, built and torn down
                pass
            how = "in a user namespace" if os.environ.get(USERNS_FLAG) else "as root"
            print(f"ok: this machine builds lab networks ({how}).")
            return 0
        return COMMANDS[args.command](args)
    except (ValueError, _net.LabError) as e:
        if os.environ.get("JAXCOMP_TRACEBACK"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        if isinstance(e, _net.LabTimeout):
            return _hosts.EXIT_TIMEOUT
        return EXIT_SETUP if isinstance(e, ValueError) else EXIT_FAILED
    except _hosts.Stopped as e:
        print(f"jaxcomp.lab: {e}; the network and its hosts are torn down.", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("jaxcomp.lab: interrupted; the network and its hosts are torn down.",
              file=sys.stderr)  # fmt: skip
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
