"""Pipeline benchmark: compressed GPipe step time vs the identity step, and bytes per step.

``python -m jaxcomp.bench pipeline [--json PATH] [--repeats R] [--stages S] [--microbatches M]
[--microbatch-size B] [--width W] [--only LABELS] [--schedules MODELS] [--schedule-microbatches
LIST] [--no-replicas]``

Two parts. The link table below; then GPipe vs 1F1B against ``M`` (peak and ideal memory, step
time, bytes per axis, per-stage ``jax.checkpoint``, compressed replica averaging): see
:mod:`jaxcomp.bench._pipeline_schedules`, whose records carry ``benchmark`` = ``"schedules"`` /
``"replicas"``. The JSON also records ``cat /proc/loadavg`` before and after.

A stack of ``S`` MLP stages (``tanh(x W + b)``, width ``W``) runs one training step (loss,
gradients, link states) as :func:`jaxcomp.pipeline.distribute` over ``S`` fake CPU devices with
``M`` microbatches of ``B`` rows. For every link configuration:

* ``step_time_s``: median time of the jitted step, measured round-robin with the identity
  links' step (``identity_step_time_s``) in the same run, so ``time_ratio`` is robust to load;
  ``simulate_step_time_s``: the same step with :func:`jaxcomp.pipeline.simulate` on one device;
* ``hlo_bytes_per_step``: bytes of the compiled step's ``collective-permute`` ops (the boundary
  sends) read by :func:`jaxcomp.comm.measure_collectives`, per pipeline replica;
  ``hlo_other_bytes``: every other collective (the scalar loss all-reduce);
* ``theory_bytes_per_step``: ``M`` times the payload bytes of each boundary's forward and
  backward sends (:func:`jaxcomp.compressors.wire_bytes`); ``dense_bytes_per_step``: the same
  sends uncompressed;
* ``bubble_fraction``: GPipe's ``(S - 1) / (M + S - 1)``.

On fake CPU devices the "network" is a memory copy, so the time ratio measures the cost of
encoding and decoding, not the bandwidth saved; on a real interconnect the bytes column is what
compression buys.
"""

from __future__ import annotations

from jaxcomp._cpu import HostMalloc
from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import compressors as C  # noqa: E402
from jaxcomp import feedback as F  # noqa: E402
from jaxcomp import pipeline  # noqa: E402
from jaxcomp.bench import _pipeline_schedules  # noqa: E402


def link_table(num_samples: int) -> list[tuple[str, pipeline.Link]]:
    """(label, link) for every benchmarked boundary configuration (the same on every boundary)."""
    top10 = C.top_k(0.1, per_sample=True)
    top10_block = C.top_k(0.1, per_sample=True, method="blockwise", block_size=256)
    return [
        ("identity", pipeline.link()),
        ("cast_bf16", pipeline.link(C.cast("bfloat16"), C.cast("bfloat16"))),
        ("quant8", pipeline.link(C.quantize(8), C.quantize(8))),
        ("quant4_feature/quant8", pipeline.link(C.quantize(4, scale="feature"), C.quantize(8))),
        ("topk10%", pipeline.link(top10, top10)),
        ("topk10%_blockwise", pipeline.link(top10_block, top10_block)),
        ("topk10%+EF", pipeline.link(F.error_feedback(top10), F.error_feedback(top10))),
        ("topk10%_shared_mask", pipeline.link(top10, mode="shared_mask")),
        ("ef21_topk10%/quant8", pipeline.link(F.ef21(top10), C.quantize(8))),
        (
            "aq_sgd_quant4/quant8",
            pipeline.link(F.aq_sgd(C.quantize(4), num_samples), C.quantize(8)),
        ),
    ]


def _model(stages: int, width: int, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
         "b": jnp.zeros((width,), jnp.float32)}
        for _ in range(stages)
    ]  # fmt: skip
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
        "label": jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
        "ids": jnp.arange(rows, dtype=jnp.int32),
    }

    def stage(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def loss_fn(y, labels):
        return jnp.mean((y - labels) ** 2)

    return pipeline.StagedModel((stage,) * stages, loss_fn), params, batch


def run(
    stages: int = 4,
    microbatches: int = 8,
    microbatch_size: int = 32,
    width: int = 1024,
    repeats: int = 20,
    only: tuple[str, ...] = (),
) -> list[dict]:
    """Benchmarks every link configuration (or those labelled in ``only``); returns one record
    per configuration."""
    rows = microbatches * microbatch_size
    model, params, batch = _model(stages, width, rows)
    mesh = pipeline.pipeline_mesh(stages, jax.devices()[:stages])
    packed = pipeline.pack_params(params, NamedSharding(mesh, P(comm.STAGE)))
    batch = jax.device_put(batch, NamedSharding(mesh, P()))
    key = jax.random.key(0)

    def compiled(link):
        """The link's gpipe and simulate steps, compiled once (timed, and metered from HLO)."""
        config = pipeline.PipelineConfig(microbatches, link)
        pipe, sim = pipeline.distribute(model, config, mesh), pipeline.simulate(model, config)
        args = (packed, batch, pipe.init(packed, batch), key)
        sim_args = (params, batch, sim.init(params, batch), key)
        step = jax.jit(pipe.step).lower(*args).compile()
        sim_step = jax.jit(sim.step).lower(*sim_args).compile()
        return pipe, (step, args), (sim_step, sim_args)

    identity = compiled(pipeline.link())
    results = []
    for label, link in link_table(rows):
        if only and label not in only:
            continue
        pipe, call, sim_call = identity if label == "identity" else compiled(link)
        t_step, t_identity, t_sim = _common.time_interleaved([call, identity[1], sim_call], repeats)
        report = comm.collective_report(call[0].as_text()).bytes_by_kind()
        counts = pipe.bytes_per_step(params, batch)
        hlo = report.pop("collective-permute", 0.0)
        results.append(
            dict(
                codec=label,
                forward=link.forward.name,
                backward=link.backward.name if link.backward else "shared mask",
                mode=link.mode,
                stages=stages,
                microbatches=microbatches,
                microbatch_size=microbatch_size,
                width=width,
                step_time_s=t_step,
                identity_step_time_s=t_identity,
                time_ratio=t_step / t_identity,
                simulate_step_time_s=t_sim,
                hlo_bytes_per_step=hlo,
                hlo_other_bytes=float(sum(report.values())),
                theory_bytes_per_step=counts["wire_bytes"],
                dense_bytes_per_step=counts["dense_bytes"],
                compression=counts["dense_bytes"] / counts["wire_bytes"],
                bubble_fraction=pipeline.bubble_fraction(stages, microbatches),
            )
        )
        r = results[-1]
        print(
            f"  {label:24s} {r['step_time_s'] * 1e3:8.2f} ms ({r['time_ratio']:4.2f}x identity)"
            f"  {r['hlo_bytes_per_step']:>10.0f} B sent ({r['compression']:4.1f}x less)"
        )
    return results


def _schedule_part(args) -> list[dict]:
    """GPipe vs 1F1B records (and checkpointed stages, replica averaging) with their table and
    the issue's targets checked in the same run."""
    models = tuple(filter(None, args.schedules.split(",")))
    ms = tuple(int(v) for v in args.schedule_microbatches.split(",") if v)
    records = []
    for name in models:
        records += _pipeline_schedules.schedule_records(name, ms, repeats=args.schedule_repeats)
    if "cnn" in models:
        records += _pipeline_schedules.schedule_records(
            "cnn", ms[:1] + ms[-1:], repeats=args.schedule_repeats, checkpoint=True
        )
    if args.replicas:
        records += _pipeline_schedules.replica_records(repeats=args.schedule_repeats)
    rows = [r for r in records if r["benchmark"] == "schedules"]
    for r in rows:
        r["peak_mib"] = r["peak_bytes"] / 2**20
        r["temp_mib"] = r["temp_bytes"] / 2**20
        r["ideal_mib"] = r["ideal_activation_bytes"] / 2**20
        r["residual_mib"] = r["residual_buffer_bytes"] / 2**20
        r["time_vs_identity"] = r["step_time_s"] / r["identity_step_time_s"]
    print()
    _common.print_table(
        rows,
        [
            ("model", "s"), ("schedule", "s"), ("num_microbatches", "d"), ("checkpoint", "d"),
            ("peak_mib", ".2f"), ("temp_mib", ".2f"), ("residual_mib", ".2f"),
            ("ideal_mib", ".2f"), ("step_time_s", ".4f"), ("identity_step_time_s", ".4f"),
            ("time_vs_identity", ".2f"), ("hlo_bytes_per_step", ".0f"),
            ("theory_bytes_per_step", ".0f"),
        ],
    )  # fmt: skip
    _check_targets(rows)
    return records


def _check_targets(rows: list[dict]) -> None:
    """Prints the issue's targets as measured in this run (met or not, with the numbers)."""
    plain = [r for r in rows if not r["checkpoint"]]
    for name in sorted({r["model"] for r in plain}):
        by = {(r["schedule"], r["num_microbatches"]): r for r in plain if r["model"] == name}
        ms = sorted({m for _, m in by})
        lo, hi = ms[0], ms[-1]
        for schedule in pipeline.SCHEDULES:
            growth = by[schedule, hi]["peak_bytes"] / by[schedule, lo]["peak_bytes"]
            print(f"{name}: {schedule} peak_bytes M={hi} / M={lo}: {growth:.3f}")
        for m in ms:
            f, g = by["1f1b", m], by["gpipe", m]
            ratio = f["step_time_s"] / g["step_time_s"]
            act = f["residual_buffer_bytes"] / f["ideal_activation_bytes"]
            print(
                f"{name} M={m}: 1F1B / GPipe step time {ratio:.3f} (target <= 1.15); 1F1B "
                f"residual buffers / ideal {act:.3f} (target <= 1.5)"
            )
        live = [(r["link_state_bytes_per_device"], r["live_link_state_bytes"]) for r in plain]
        worst = max(abs(a / b - 1) for a, b in live if b)
        print(f"{name}: AQ-SGD link-state bytes per device vs live size: within {worst:.2%}")


def main(argv: list[str] | None = None, host_malloc: HostMalloc | None = None) -> int:
    p = _common.parser(__doc__, __name__)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (stage-axis devices)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--microbatch-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--width", type=int, default=1024, help="width of the MLP stages")
    p.add_argument("--only", default="", help="comma-separated labels to run (default: all)")
    p.add_argument(
        "--schedules", default="cnn,gpt", help="models of the GPipe vs 1F1B part ('' skips it)"
    )
    p.add_argument("--schedule-microbatches", default="4,8,16,32", help="M values, S = 4")
    p.add_argument("--schedule-repeats", type=int, default=10, help="timings per GPipe / 1F1B row")
    p.add_argument(
        "--no-replicas",
        dest="replicas",
        action="store_false",
        help="leave out the rows with data-parallel pipeline replicas",
    )
    args = p.parse_args(argv)
    only = tuple(filter(None, args.only.split(",")))
    load_before = _common.load_average()
    results = run(
        args.stages, args.microbatches, args.microbatch_size, args.width, args.repeats, only
    )
    print()
    _common.print_table(
        results,
        [
            ("codec", "s"),
            ("step_time_s", ".4f"),
            ("identity_step_time_s", ".4f"),
            ("time_ratio", ".2f"),
            ("simulate_step_time_s", ".4f"),
            ("hlo_bytes_per_step", ".0f"),
            ("theory_bytes_per_step", "d"),
            ("dense_bytes_per_step", "d"),
            ("compression", ".1f"),
            ("bubble_fraction", ".3f"),
        ],
    )
    mismatched = [
        r["codec"] for r in results if r["hlo_bytes_per_step"] != r["theory_bytes_per_step"]
    ]
    if mismatched:
        print(f"HLO bytes differ from the theoretical payload bytes for: {mismatched}")
    results += _schedule_part(args)
    _common.write_json(
        args.json, "pipeline", results, loadavg_before=load_before,
        loadavg_after=_common.load_average(), host_malloc=host_malloc,
    )  # fmt: skip
    return 1 if mismatched else 0
