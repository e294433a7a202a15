r"""``python -m jaxcomp.study``: run a study, report on it, or list the studies.

  python -m jaxcomp.study list
  python -m jaxcomp.study run paper1_direction --workdir runs/paper1_direction [--smoke]
      [--set KEY=VALUE ...] [--preset forward-only|backward-only|both] [--cells PATTERN ...]
  python -m jaxcomp.study report runs/paper1_direction [--out DIR] [--compute_s SECONDS]

``run`` runs every cell not yet finished (a rerun after a kill continues where it stopped),
then writes the report; ``--set`` adds overrides to every cell (Python literals, as
``jaxcomp.main``'s: ``--set pipeline.forward.fraction=0.05``); ``--preset`` moves every cell's
pipeline codec to the activations only, the activation-gradients only or both (uncompressed
cells stay so); ``--cells`` runs only the cells whose names match the shell-style patterns.
A bad study, config or workdir exits with one ``error:`` line (status 2); a study with failed
cells exits with status 1; SIGINT/SIGTERM finish the running cell's step, save its checkpoint
and exit with status 75 (rerun the same command to continue).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from jaxcomp.study._grid import PRESETS

EXIT_INTERRUPTED = 75  # as jaxcomp.main: the study is resumable


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.study", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the studies in configs/studies/")
    run = sub.add_parser("run", help="run a study's cells one after another, then report")
    run.add_argument("study", help="a study name in configs/studies/ or a path to a study file")
    run.add_argument("--workdir", required=True, help="the study's folder (one subfolder per run)")
    run.add_argument("--smoke", action="store_true", help="every cell for 2 steps")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="an override for every cell (repeatable)")  # fmt: skip
    run.add_argument("--preset", default=None, choices=PRESETS,
                     help="every cell's pipeline codec on these directions")  # fmt: skip
    run.add_argument("--cells", action="append", default=[], metavar="PATTERN",
                     help="run only the cells matching PATTERN (repeatable)")  # fmt: skip
    run.add_argument("--studies_dir", default=None, help="where study files live")
    run.add_argument("--cpu_devices", type=int, default=8, help="fake CPU devices")
    run.add_argument(
        "--compile_cache",
        default=None,
        help="JAX's persistent compilation cache, shared by the runs (seeds and variants "
        "compile the same programs): default WORKDIR/.jax_cache, none on CPU (off there: "
        "docs/results/accbug); 'none' to turn it off",
    )
    report = sub.add_parser("report", help="tables, CSVs and plots of a study's runs")
    report.add_argument("workdir", help="the folder of a `run` (its --workdir)")
    report.add_argument("--out", default=None, help="where to write (default: the workdir)")
    report.add_argument("--compute_s", type=float, default=None,
                        help="compute seconds per step for the predicted speedups")  # fmt: skip
    return p.parse_args(argv)


def _list(studies_dir=None) -> None:
    from jaxcomp.study import _grid

    folder = _grid.repo_configs_dir() / "studies" if studies_dir is None else studies_dir
    for path in sorted(folder.glob("*.py")):
        study = _grid.load_study(str(path))
        runs = len(_grid.cells(study))
        print(f"{study.name}: {runs} runs")
        print(textwrap.indent(textwrap.fill(_summary(study.doc), 92), "    "))


def _summary(doc: str) -> str:
    """A study docstring's first paragraph, as one line (whole sentences)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _compile_cache(args) -> None:
    """Every run compiles its programs anew; a persistent cache makes the repeats cheap.
    ``$JAX_COMPILATION_CACHE_DIR`` wins. On CPU the default is no cache, and an explicit
    ``--compile_cache`` is turned off with a warning (``docs/results/accbug``)."""
    if args.compile_cache == "none" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    from jaxcomp import _cpu
    from jaxcomp import main as jaxcomp_main

    if args.compile_cache is None and not _cpu.compile_cache_allowed(jax.default_backend()):
        return
    jaxcomp_main.enable_compile_cache(
        args.compile_cache or os.path.join(args.workdir, ".jax_cache")
    )
    jaxcomp_main.refuse_cpu_compile_cache()


def main(argv=None, *, compile_cache: bool = False) -> int:
    """Runs the CLI with ``argv``; returns the exit status.

    ``compile_cache``: turn on JAX's persistent compilation cache (``--compile_cache``) for
    this process. Only the command-line process does (it is process-wide JAX configuration);
    a caller of this function keeps its own.
    """
    args = parse_args(argv)
    try:
        if args.command == "list":
            _list()
            return 0
        if args.command == "report":
            from jaxcomp.study import _write

            paths = _write.write_report(args.workdir, args.out, compute_s=args.compute_s)
            print(f"report: {paths['markdown']}")
            return 0
        from jaxcomp import main as jaxcomp_main

        jaxcomp_main.setup_devices(
            argparse.Namespace(
                cpu_devices=args.cpu_devices,
                num_processes=None,
                coordinator_address=None,
                process_id=None,
                host_malloc=None,  # $JAXCOMP_HOST_MALLOC, else glibc's defaults
            )  # fmt: skip
        )
        if compile_cache:
            _compile_cache(args)
        from jaxcomp import train
        from jaxcomp.study import _grid
        from jaxcomp.study import _runner
        from jaxcomp.study import _write

        study = _grid.load_study(args.study, args.studies_dir)
        try:
            statuses = _runner.run_study(
                study,
                args.workdir,
                smoke=args.smoke,
                extra=train.parse_overrides(args.set),
                preset=args.preset,
                only=args.cells,
            )
        except train.Interrupted as e:
            print(f"interrupted ({e}): the running cell saved its checkpoint; rerun the same "
                  "command to continue.", file=sys.stderr, flush=True)  # fmt: skip
            return EXIT_INTERRUPTED
        except train.Aborted as e:
            print(f"{e} The cell's last finished checkpoint is kept; rerun to continue.",
                  file=sys.stderr, flush=True)  # fmt: skip
            sys.stdout.flush()
            os._exit(128 + e.signum)  # as jaxcomp.main: no wait for background saves
        except KeyboardInterrupt:  # between cells: no trainer handler was installed
            print("interrupted between cells; rerun the same command to continue.",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 128 + 2
        paths = _write.write_report(args.workdir)
        print(f"report: {paths['markdown']}")
        failed = sorted(k for k, v in statuses.items() if v == "failed")
        if failed:
            print(f"error: {len(failed)} run(s) failed: {failed[:5]}; rerun to retry them.",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    except ValueError as e:
        if os.environ.get("JAXCOMP_TRACEBACK"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    from jaxcomp._broken_pipe import run_cli

    sys.exit(run_cli(main, compile_cache=True))
