r"""Runs one experiment: ``python -m jaxcomp.main --config configs/X.py[:smoke] --workdir DIR``.

This file is intentionally thin (as the Flax examples' ``main.py``): it sets up devices and
processes, loads the config and calls :func:`jaxcomp.train.train_and_evaluate`.

On CPU it gives JAX ``--cpu_devices`` (default 8) fake devices *before* JAX starts its backend,
so the default 4-stage pipeline runs on one machine. For several hosts pass
``--coordinator_address``, ``--num_processes`` and ``--process_id`` (or set
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); CPU processes talk over
gloo. A bad config, name or mesh exits with a one-line ``error:`` before training starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.main", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="configs/NAME.py, optionally :ARG (e.g. :smoke)")
    p.add_argument("--workdir", required=True, help="run directory (checkpoints, metrics, plot)")
    p.add_argument("--cpu_devices", type=int, default=8, help="fake CPU devices per process")
    p.add_argument("--coordinator_address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    p.add_argument("--num_processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    p.add_argument("--process_id", type=int, default=_env_int("JAX_PROCESS_ID"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value by dotted key, the value a Python literal or a bare "
        "string, e.g. --set total_steps=100 --set pipeline.forward.fraction=0.05 (repeatable)",
    )
    p.add_argument("--stop_after", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def load_config(spec: str):
    """Imports ``path.py`` and calls its ``get_config(arg)`` (``path.py:arg``)."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist.")
    module_spec = importlib.util.spec_from_file_location("jaxcomp_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} has no get_config(arg) function.")
    return module.get_config(arg or None)


def setup_devices(args) -> None:
    """Fake CPU devices and multi-process initialisation, before JAX's backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}"
        )
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except RuntimeError:  # backend already started (e.g. imported by a caller)
        pass
    if args.num_processes and args.num_processes > 1:
        if args.coordinator_address is None or args.process_id is None:
            raise ValueError("multi-process runs need --coordinator_address and --process_id.")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        setup_devices(args)
        config = load_config(args.config)
        from jaxcomp import train

        config = train.apply_overrides(config, train.parse_overrides(args.set))

        train.train_and_evaluate(config, args.workdir, stop_after=args.stop_after)
    except (ValueError, KeyError) as e:
        if os.environ.get("JAXCOMP_TRACEBACK"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        if type(e).__name__ == "NonFiniteError":
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 3
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
