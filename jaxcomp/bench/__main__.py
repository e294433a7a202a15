"""Entry point: ``python -m jaxcomp.bench NAME [--json PATH] [options]``."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "compressors": "jaxcomp.bench.compressors",
    "pipeline": "jaxcomp.bench.pipeline",
    "data_parallel": "jaxcomp.bench.data_parallel",
    "ab_training": "jaxcomp.bench.ab_training",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(BENCHMARKS)
        print(f"usage: python -m jaxcomp.bench {{{names}}} [--json PATH] [options]")
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
