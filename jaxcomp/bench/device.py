"""The compressor, pipeline and data-parallel benchmarks on this machine's accelerators, in one
table: ``python -m jaxcomp.bench device [--tiny] [--only ...] [--json PATH]``.

On a machine with GPUs or TPUs it runs :mod:`jaxcomp.bench.compressors` (encode + decode time
against a copy of the same array), :mod:`jaxcomp.bench.pipeline` (a pipeline step against the
identity-link step, on ``min(4, devices)`` stages) and :mod:`jaxcomp.bench.data_parallel`
(a ResNet-18-sized compressed mean against a dense ``pmean``, on ``min(8, devices)`` workers)
at their default sizes, and prints one row per configuration: the time, its baseline, the
ratio, the bytes that crossed the collectives (read from the compiled program) and the
compression. The two multi-device benchmarks need at least two devices.

Without an accelerator it says so and exits 0; ``--tiny`` runs everything at a tiny size on
whatever devices there are (fake CPU devices included), to check the script itself.
"""

from __future__ import annotations

import sys
from typing import Any

from jaxcomp._cpu import HostMalloc
from jaxcomp.bench import _common

_common.request_cpu_devices(8)  # before JAX starts; only CPU-only machines (and --tiny) use them
PARTS = ("compressors", "pipeline", "data_parallel")
COLUMNS = [
    ("benchmark", "s"),
    ("name", "s"),
    ("time_ms", ".3f"),
    ("baseline", "s"),
    ("baseline_ms", ".3f"),
    ("ratio", ".2f"),
    ("wire_bytes", ".0f"),
    ("compression", ".1f"),
]
# tiny sizes: seconds on CPU, enough to run every code path once
TINY = {
    "n": 64 * 1024,
    "pipeline": dict(microbatches=4, microbatch_size=4, width=64, only=("identity", "quant8")),
    "dp_only": ("quantize_8",),
}


def accelerators() -> list[Any]:
    """The devices that are not CPUs."""
    import jax

    return [d for d in jax.devices() if d.platform != "cpu"]


def _compressor_rows(n: int, repeats: int) -> list[dict]:
    from jaxcomp.bench import compressors

    return [
        dict(
            benchmark="compressors",
            name=r["name"],
            time_ms=1e3 * r["time_s"],
            baseline="copy",
            baseline_ms=1e3 * r["copy_time_s"],
            ratio=r["ratio_to_copy"],
            wire_bytes=r["hlo_bytes"],
            compression=r["compression"],
        )  # fmt: skip
        for r in compressors.run(n, repeats)[0]
    ]


def _pipeline_rows(stages: int, repeats: int, tiny: bool) -> list[dict]:
    from jaxcomp.bench import pipeline

    sizes = TINY["pipeline"] if tiny else {}
    return [
        dict(
            benchmark=f"pipeline S={stages}",
            name=r["codec"],
            time_ms=1e3 * r["step_time_s"],
            baseline="identity",
            baseline_ms=1e3 * r["identity_step_time_s"],
            ratio=r["time_ratio"],
            wire_bytes=r["hlo_bytes_per_step"],
            compression=r["compression"],
        )  # fmt: skip
        for r in pipeline.run(stages=stages, repeats=repeats, **sizes)
    ]


def _data_parallel_rows(workers: int, repeats: int, tiny: bool) -> list[dict]:
    from jaxcomp.bench import data_parallel

    only = TINY["dp_only"] if tiny else ()
    return [
        dict(
            benchmark=f"data_parallel W={workers}",
            name=f"{r['codec']} ({r['path']})",
            time_ms=1e3 * r["step_time_s"],
            baseline="dense pmean",
            baseline_ms=1e3 * r["dense_step_time_s"],
            ratio=r["time_ratio_to_dense"],
            wire_bytes=r["hlo_bytes_per_step"],
            compression=r.get("compression"),
        )  # fmt: skip
        for r in data_parallel.run(workers, repeats, (), only)
    ]


def run(parts=PARTS, repeats: int = 20, tiny: bool = False) -> tuple[list[dict], list[str]]:
    """Runs the chosen benchmarks on every device; returns ``(rows, skipped reasons)``."""
    import jax

    n_dev = len(jax.devices())
    rows: list[dict] = []
    skipped: list[str] = []
    if "compressors" in parts:
        rows += _compressor_rows(TINY["n"] if tiny else 4 * 1024 * 1024, repeats)
    for part, lo, hi, fn in (("pipeline", 2, 4, _pipeline_rows),
                             ("data_parallel", 2, 8, _data_parallel_rows)):  # fmt: skip
        if part not in parts:
            continue
        if n_dev < lo:
            skipped.append(f"{part}: needs {lo} devices, this machine has {n_dev}")
            continue
        rows += fn(min(hi, n_dev), repeats, tiny)
    return rows, skipped


def main(argv: list[str] | None = None, host_malloc: HostMalloc | None = None) -> int:
    p = _common.parser(__doc__, __name__)
    p.set_defaults(repeats=20)
    p.add_argument("--tiny", action="store_true", help="tiny sizes, also on CPU-only machines")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    args = p.parse_args(argv)
    parts = tuple(x for x in args.only.split(",") if x)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    import jax

    found = accelerators()
    if not found and not args.tiny:
        print(
            f"no accelerator: JAX's backend is {jax.default_backend()!r} "
            f"({len(jax.devices())} {jax.devices()[0].platform} device(s)); nothing to run. "
            "On a GPU or TPU machine this runs the compressor, pipeline and data-parallel "
            "benchmarks; --tiny runs them at a tiny size here."
        )
        return 0
    kinds = sorted({d.device_kind for d in jax.devices()})
    print(f"devices: {len(jax.devices())} x {', '.join(kinds)} (backend {jax.default_backend()})")
    rows, skipped = run(parts, args.repeats, args.tiny)
    print()
    _common.print_table(rows or [{}], COLUMNS)
    for reason in skipped:
        print(f"skipped {reason}")
    _common.write_json(
        args.json,
        "device",
        rows,
        skipped=skipped,
        tiny=args.tiny,
        load=_common.load_average(),
        host_malloc=host_malloc,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
