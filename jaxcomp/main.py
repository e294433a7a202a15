r"""Runs one experiment: ``python -m jaxcomp.main --config NAME[:smoke] --workdir DIR``.

``NAME`` is a config of the package (``digits_pipeline``; the repository's ``configs/``, shipped
in the wheel as ``jaxcomp/configs``) or a path to a config file (``configs/X.py``, your own).

This file is intentionally thin (as the Flax examples' ``main.py``): it sets up devices and
processes, loads the config, applies ``--set`` overrides (:func:`jaxcomp.train.apply_overrides`)
and calls :func:`jaxcomp.train.train_and_evaluate`.

On CPU it gives JAX ``--cpu_devices`` (default 8) fake devices *before* JAX starts its backend,
so the default 4-stage pipeline runs on one machine. ``--host_malloc=keep`` (or
``JAXCOMP_HOST_MALLOC=keep``) sets glibc to keep freed host memory for reuse
(the CPU door, ``jaxcomp._cpu``; off by default: it slowed the digits trainer). Several
processes (hosts) are joined with
``jax.distributed.initialize`` (:func:`distributed_plan`): explicit ``--coordinator_address``,
``--num_processes`` and ``--process_id`` (or ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``) win; otherwise ``--distributed=auto`` (the default) lets JAX detect the
cluster when a multi-process SLURM job (``srun``), Open MPI (``mpirun``) or a multi-host TPU
slice on GKE is in the environment, ``--distributed=on`` always asks JAX to detect it (a Cloud
TPU VM pod, found through its metadata server), ``--distributed=off`` never joins. CPU processes
talk over gloo.

``--compile_cache DIR`` (or ``JAXCOMP_COMPILE_CACHE=DIR``) keeps every compiled program in
``DIR`` (JAX's persistent compilation cache, :func:`enable_compile_cache`), so a later run of
the same programs loads them instead of compiling: a rerun, a resumed run or a sweep over seeds
skips the setup's compiles. A damaged entry is compiled again (JAX warns), never loaded. The
cache's keys include its directory's path, so a moved or copied cache compiles afresh. **On
CPU the cache is turned off** with a ``warning:`` line (``$JAX_COMPILATION_CACHE_DIR`` too): a
cached multi-device CPU program was found to compute differently from a fresh compile
(``docs/results/accbug``); ``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1`` keeps it on.

The config file is loaded as ml_collections' ``config_flags`` does (``path.py:arg`` calls
``get_config(arg)``); ``arg`` must be one the file accepts: its ``ARGS`` tuple, by default
``("smoke",)``. (``config_flags`` itself is not used: its ``--config.key=value`` overrides
cannot turn a codec name into a spec dict, and its flags live in absl's process-wide registry.)

Exit codes:
  0: finished (or already finished: nothing to do).
  1: a bug: an uncaught exception, with its traceback.
  2: a setup problem (config, ``--set``, mesh, workdir), one ``error:`` line before training.
  2 is also the exit of a run refused because another live run holds the workdir (its line
     names that run: pid, host, start time).
  3: too many non-finite steps in a row (the last finite state is saved).
  69: another process of a multi-process run died, stopped answering or could not be reached
      (``EX_UNAVAILABLE``); the line names it. The last good checkpoint stays: run the same
      command on every host to resume.
  74: a checkpoint or the workdir could not be written (disk full, read-only, deleted during
      the run; ``EX_IOERR``); the line names the folder and the bytes needed. The last good
      checkpoint stays.
  75: stopped by SIGTERM/SIGINT after finishing a step and saving a checkpoint (``EX_TEMPFAIL``:
      run the same command again to resume); also a signal during startup, before training.
  128 + N: aborted by a second signal N, without saving (the last finished checkpoint stays).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from jaxcomp import _early_signals
from jaxcomp import _pyfile

EXIT_SETUP = 2
EXIT_NONFINITE = 3
EXIT_PEER_LOST = 69  #: = jaxcomp.train.PeerLost.exit_code
EXIT_STORAGE = 74
EXIT_INTERRUPTED = 75
DISTRIBUTED = ("auto", "on", "off")


class UsageError(ValueError):
    """A bad command line or config file (reported as one line, exit 2)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.main", description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        required=True,
        help="a config name (digits_pipeline, ...) or a file (configs/NAME.py, your own), "
        "optionally :ARG (e.g. :smoke)",
    )
    p.add_argument("--workdir", required=True, help="run directory (checkpoints, metrics, plot)")
    p.add_argument("--cpu_devices", type=int, default=8, help="fake CPU devices per process")
    p.add_argument(
        "--host_malloc",
        choices=("keep", "default"),
        default=None,
        help="keep: freed host memory kept for reuse (glibc); default: $JAXCOMP_HOST_MALLOC, "
        "else glibc's defaults",
    )
    p.add_argument(
        "--compile_cache",
        default=os.environ.get("JAXCOMP_COMPILE_CACHE") or None,
        metavar="DIR",
        help="keep the compiled programs in DIR and load them in later runs instead of "
        "compiling (JAX's persistent compilation cache; off on CPU, see "
        "docs/results/accbug); default: $JAXCOMP_COMPILE_CACHE, else off",
    )
    p.add_argument("--coordinator_address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    p.add_argument("--num_processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    p.add_argument("--process_id", type=int, default=_env_int("JAX_PROCESS_ID"))
    p.add_argument(
        "--distributed",
        choices=DISTRIBUTED,
        default="auto",
        help="join the other processes of a cluster with jax.distributed.initialize(): 'auto' "
        "when a multi-process SLURM/Open MPI/GKE TPU environment is detected, 'on' always "
        "(auto-detection by JAX, e.g. a Cloud TPU VM pod), 'off' never; explicit "
        "--coordinator_address/--num_processes/--process_id win",
    )
    p.add_argument(
        "--peer_timeout",
        type=float,
        default=_env_float("JAXCOMP_PEER_TIMEOUT", 90.0),
        metavar="SECONDS",
        help="with several processes: exit (status 69, naming the process) when the training "
        "loop makes no progress for this long because another process died, stopped or is "
        "cut off; a process back sooner does not stop the run. JAX's own heartbeat gives up "
        "30 s later. Default: $JAXCOMP_PEER_TIMEOUT, else 90",
    )
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


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def load_config(spec: str):
    """Imports ``path.py`` and returns its ``get_config(arg)`` (``path.py:arg``).

    Raises:
      UsageError: for a missing file, a file without ``get_config``, or an ``arg`` the file
        does not accept (its ``ARGS``, default ``("smoke",)``). Errors raised by the file's
        own code keep their traceback.
    """
    path, colon, arg = spec.partition(":")
    path = config_path(path)
    module = _pyfile.run_file(path, "jaxcomp_config")
    if not callable(getattr(module, "get_config", None)):
        raise UsageError(f"config file {path!r} has no get_config(arg) function.")
    allowed = tuple(getattr(module, "ARGS", ("smoke",)))
    if colon and arg not in allowed:
        raise UsageError(
            f"unknown config argument {arg!r} in {spec!r}; {path} accepts "
            f"{', '.join(repr(a) for a in allowed) or 'none'}."
        )
    config = module.get_config(arg or None)
    if not hasattr(config, "to_dict"):
        kind = type(config).__name__
        raise UsageError(f"{path}: get_config() returned a {kind}, not a ConfigDict.")
    return config


def config_path(name: str) -> str:
    """The file of a config given by path (``configs/X.py``) or by name (``digits_pipeline``,
    one of :func:`jaxcomp._resources.config_names`).

    Raises:
      UsageError: for a missing file or an unknown name (listing the known ones).
    """
    if os.path.isfile(name):
        return name
    if name.endswith(".py") or os.sep in name or "/" in name:
        raise UsageError(f"config file {name!r} does not exist.")
    from jaxcomp import _resources

    candidate = _resources.configs_dir() / f"{name}.py"
    if candidate.is_file():
        return str(candidate)
    known = ", ".join(_resources.config_names()) or "none found"
    raise UsageError(f"unknown config {name!r}; the configs are: {known}.")


def _positive_env(environ, name: str) -> int:
    try:
        return int(environ.get(name, ""))
    except ValueError:
        return 0


def detected_cluster(environ=None) -> str | None:
    """The multi-process cluster environment JAX will find, or ``None`` (a single process).

    Only environments with more than one process count: a one-task SLURM allocation or a
    single-host TPU VM runs alone.
    """
    environ = os.environ if environ is None else environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in environ for k in slurm) and _positive_env(environ, "SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and _positive_env(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return "open_mpi"
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "tpu_pod"
    return None


def distributed_plan(args, environ=None) -> dict | None:
    """The keyword arguments for ``jax.distributed.initialize``, or ``None`` to run alone.

    Explicit ``--coordinator_address``/``--num_processes``/``--process_id`` win over the
    environment; with ``--distributed=auto`` a detected cluster (:func:`detected_cluster`)
    initialises with no arguments (JAX reads the coordinator, process count and id from it);
    ``--distributed=on`` does so even when nothing was detected, ``off`` never.

    Raises:
      UsageError: for an incomplete set of explicit flags, a process id out of range, or
        ``--distributed=off`` together with explicit multi-process flags.
    """
    explicit = [args.coordinator_address, args.num_processes, args.process_id]
    # callers building their own Namespace without the flag (jaxcomp.study) keep the explicit-
    # flags-only behaviour; the CLI's default is "auto"
    mode = getattr(args, "distributed", "off")
    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num_processes must be >= 1; got {args.num_processes}.")
    if args.num_processes and args.num_processes > 1:
        if mode == "off" and hasattr(args, "distributed"):
            raise UsageError("--distributed=off contradicts --num_processes > 1.")
        if args.coordinator_address is None or args.process_id is None:
            raise UsageError("multi-process runs need --coordinator_address and --process_id.")
        if not 0 <= args.process_id < args.num_processes:
            raise UsageError(
                f"--process_id must be in [0, {args.num_processes}); got {args.process_id}."
            )
        return {
            "coordinator_address": args.coordinator_address,
            "num_processes": args.num_processes,
            "process_id": args.process_id,
        }
    if args.num_processes == 1 or mode == "off":
        return None
    if mode == "on" or detected_cluster(environ) is not None:
        # Partial explicit values (e.g. a coordinator address) still override detection.
        names = ("coordinator_address", "num_processes", "process_id")
        return {k: v for k, v in zip(names, explicit) if v is not None}
    return None


#: seconds JAX's heartbeat waits beyond ``--peer_timeout``: the trainer's own bound fires
#: first (one line, exit 69), JAX's abort (exit 134) stays the last resort
HEARTBEAT_MARGIN_S = 30


def distributed_timeouts(args) -> dict[str, int]:
    """``jax.distributed.initialize``'s heartbeat and shutdown timeouts from
    ``--peer_timeout``: a process that stops sending heartbeats is declared dead
    ``HEARTBEAT_MARGIN_S`` after the trainer's bound, and a process ending waits at most the
    bound for the others at shutdown (JAX's defaults: 100 s and 300 s).

    Raises:
      UsageError: for a bound that is not a positive number of seconds.
    """
    bound = getattr(args, "peer_timeout", None)  # jaxcomp.study's Namespace has none
    if bound is None:
        return {}
    if not bound > 0:
        raise UsageError(f"--peer_timeout must be a positive number of seconds; got {bound}.")
    return {
        "heartbeat_timeout_seconds": int(bound) + HEARTBEAT_MARGIN_S,
        "shutdown_timeout_seconds": max(int(bound), 10),
    }


def enable_compile_cache(path: str) -> str:
    """Turns on JAX's persistent compilation cache in ``path`` for every program.

    JAX's defaults keep only programs that took over a second to compile; a training run's
    setup is several programs of 0.1-1.5 s each, so every program is kept here. The cache key
    covers the program, the compile options, the devices and the JAX/XLA versions, so a
    changed config or library compiles afresh. Entries are zlib-compressed with a checksum: a
    damaged one fails to load, and JAX compiles the program again with a warning (the entry
    stays: delete the directory to clear it). The key also holds the directory's path (JAX
    puts its GPU autotuning cache inside it), so a cache read from another path misses. In a
    multi-process run only process 0 writes; every process reads.

    Args:
      path: the cache directory (created if missing; ``~`` expanded).

    Returns:
      The absolute path.

    Raises:
      UsageError: if the directory cannot be created or written.
    """
    import jax

    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--compile_cache {path!r} cannot be created: {e.strerror}.") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--compile_cache {path!r} is not a writable directory.")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def setup_devices(args) -> None:
    """Host allocator, fake CPU devices and multi-process initialisation, before JAX's backend
    starts."""
    from jaxcomp import _cpu

    _cpu.tune_host_malloc(args.host_malloc)  # None: the environment
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
    cache = getattr(args, "compile_cache", None)  # jaxcomp.study's Namespace has none
    if cache:
        enable_compile_cache(cache)
    plan = distributed_plan(args)
    if plan is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only
        timeouts = distributed_timeouts(args)
        try:
            jax.distributed.initialize(**plan, **timeouts)
        except (ValueError, RuntimeError) as e:
            where = detected_cluster() or "no cluster environment detected"
            raise UsageError(f"jax.distributed.initialize failed ({where}): {e}") from e
    refuse_cpu_compile_cache()


def refuse_cpu_compile_cache() -> None:
    """Turns a configured persistent compilation cache (``--compile_cache`` or
    ``$JAX_COMPILATION_CACHE_DIR``) off on CPU, with one ``warning:`` line on stderr
    (:func:`jaxcomp._cpu.refuse_compile_cache`). Starts the backend if a cache is configured."""
    import jax

    from jaxcomp import _cpu

    if jax.config.jax_compilation_cache_dir:
        line = _cpu.refuse_compile_cache(jax.default_backend())
        if line:
            print(f"warning: {line}", file=sys.stderr, flush=True)


def _error(e: BaseException) -> int:
    if os.environ.get("JAXCOMP_TRACEBACK"):
        raise e
    lines = str(e).strip().splitlines() or [type(e).__name__]
    more = " (more with JAXCOMP_TRACEBACK=1)" if len(lines) > 1 else ""
    print(f"error: {lines[0]}{more}", file=sys.stderr, flush=True)
    return EXIT_SETUP


#: seconds a CLI run that stopped early waits for the threads it left (a checkpoint save
#: abandoned when its workdir vanished, compiles under way at a signal) before it exits without
#: them: the interpreter's exit joins them, and a save's thread waiting for a signal that never
#: comes waited 300 s (orbax's coordination timeout)
EXIT_WAIT_S = 1.0


def threads_left(wait_s: float) -> list[str]:
    """The names of the threads (other than this one and the main one, not daemons) still
    running after waiting up to ``wait_s`` seconds in all for them to end: what the
    interpreter's exit would wait for. An idle worker of a thread pool (one that ends when the
    interpreter exits) counts too: it costs the wait, then :func:`_exit_bounded`'s immediate
    exit, which is what such an exit does anyway."""
    deadline = time.monotonic() + wait_s
    left = []
    for t in threading.enumerate():
        if t in (threading.current_thread(), threading.main_thread()) or t.daemon:
            continue
        t.join(max(deadline - time.monotonic(), 0.0))
        if t.is_alive():
            left.append(t.name)
    return left


def _exit_now(code: int) -> NoReturn:
    """Ends the process at once with ``code``, its output flushed (``os._exit``: neither the
    threads left behind nor JAX's shutdown, which waits for lost processes, are waited for)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_bounded(code: int) -> int:
    """``code``; the CLI's process exits with it at once (``os._exit``, output flushed) when
    threads it left would hold the interpreter's exit past :data:`EXIT_WAIT_S` (a call of
    :func:`main` from a program returns it as it is)."""
    if _early_signals.started_as_the_cli(getattr(sys, "orig_argv", ())) and threads_left(
        EXIT_WAIT_S
    ):
        _exit_now(code)
    return code


def _interrupted_early(signum: int) -> int:
    name = signal.Signals(signum).name
    print(f"jaxcomp: interrupted by {name} before training started.", file=sys.stderr, flush=True)
    return 128 + signum


def main(argv=None) -> int:
    # a signal is recorded, never lost (_early_signals: JAX's import drops KeyboardInterrupt);
    # `python -m jaxcomp.main` recorded it from the package's first line
    early = _early_signals.current() or _early_signals.EarlySignals().install()
    try:
        return _main(argv, early)
    finally:
        early.restore()


def _main(argv, early: _early_signals.EarlySignals) -> int:
    args = parse_args(argv)
    try:
        setup_devices(args)
        config = load_config(args.config)
    except UsageError as e:
        return _error(e)
    except KeyboardInterrupt:
        return _interrupted_early(early.signum or signal.SIGINT)
    if early.signum is not None:
        return _interrupted_early(early.signum)
    from jaxcomp import train

    try:
        try:
            config = train.apply_overrides(config, train.parse_overrides(args.set))
        except ValueError as e:
            raise train.SetupError(str(e)) from e
        train.train_and_evaluate(
            config, args.workdir, stop_after=args.stop_after, peer_timeout_s=args.peer_timeout
        )
    except train.SetupError as e:
        return _error(e)
    except train.NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except train.StorageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        import jax

        if jax.process_count() > 1:  # a failed save's threads wait in barriers, never ending
            _exit_now(EXIT_STORAGE)
        return _exit_bounded(EXIT_STORAGE)
    except train.PeerLost as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _exit_now(EXIT_PEER_LOST)  # JAX's exit would wait for the lost process
    except train.Interrupted as e:
        print(f"jaxcomp: {e}", file=sys.stderr, flush=True)
        return _exit_bounded(EXIT_INTERRUPTED)  # compiles under way at a signal are dropped
    except train.Aborted as e:
        print(f"jaxcomp: {e} The last finished checkpoint is kept.", file=sys.stderr, flush=True)
        _exit_now(128 + e.signum)  # do not wait for background save threads
    except KeyboardInterrupt:
        return _interrupted_early(early.signum or signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
