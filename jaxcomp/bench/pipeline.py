"""Pipeline benchmark: compressed GPipe step time vs the identity step, and bytes per step.

``python -m jaxcomp.bench pipeline [--json PATH] [--repeats R] [--stages S] [--microbatches M]
[--microbatch-size B] [--width W]``

A stack of ``S`` MLP stages (``tanh(x W + b)``, width ``W``) runs one training step (loss,
gradients, link states) as :func:`jaxcomp.pipeline.gpipe` over ``S`` fake CPU devices with
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
        pipe, sim = pipeline.gpipe(model, config, mesh), pipeline.simulate(model, config)
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


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--only", default="", help="comma-separated labels to run (default: all)")
    args = p.parse_args(argv)
    only = tuple(filter(None, args.only.split(",")))
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
    _common.write_json(args.json, "pipeline", results)
    return 1 if mismatched else 0
