"""Entry point: ``python -m jaxcomp.bench NAME [--json PATH] [options]``.

``python -m jaxcomp.bench --help`` lists the benchmarks with their flags;
``python -m jaxcomp.bench NAME --help`` shows one benchmark's.

With ``JAXCOMP_HOST_MALLOC=keep`` the host allocator keeps freed memory for reuse before a
benchmark starts JAX's backend (:func:`jaxcomp._cpu.tune_host_malloc`; unset: glibc's defaults, as
the main job); every JSON file records which under ``env.host_malloc``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys

BENCHMARKS = {
    "compressors": "jaxcomp.bench.compressors",
    "pipeline": "jaxcomp.bench.pipeline",
    "data_parallel": "jaxcomp.bench.data_parallel",
    "ab_training": "jaxcomp.bench.ab_training",
    "device": "jaxcomp.bench.device",
    "peers": "jaxcomp.bench.peers",
}
USAGE = f"usage: python -m jaxcomp.bench {{{','.join(BENCHMARKS)}}} [--json PATH] [options]"


def _help(name: str) -> str:
    """A benchmark's own ``--help`` text (its argument parser prints it and exits 0)."""
    out, argv0 = io.StringIO(), sys.argv[0]
    sys.argv[0] = f"python -m jaxcomp.bench {name}"  # argparse's prog
    try:
        with contextlib.redirect_stdout(out):
            importlib.import_module(BENCHMARKS[name]).main(["--help"])
    except SystemExit:
        pass
    finally:
        sys.argv[0] = argv0
    return out.getvalue().strip()


def full_help() -> str:
    """The usage line, then every benchmark's flags."""
    parts = [USAGE, ""]
    for name in BENCHMARKS:
        parts += [f"== {name} ==", _help(name), ""]
    return "\n".join(parts).rstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(full_help())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        got = f"unknown benchmark {argv[0]!r}; " if argv else ""
        print(f"{got}{USAGE}\n(--help lists every benchmark's flags)", file=sys.stderr)
        return 2
    from jaxcomp import _cpu

    try:
        host_malloc = _cpu.tune_host_malloc(None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:], host_malloc=host_malloc) or 0)


if __name__ == "__main__":
    from jaxcomp._broken_pipe import run_cli

    sys.exit(run_cli(main))
