"""Data-parallel gradient averaging on a ResNet-18-sized tree: bytes from HLO and step time.

``python -m jaxcomp.bench data_parallel [--json PATH] [--repeats R] [--workers W]
[--scaling 2,4,8] [--only power_sgd,top_k] [--tables codecs,scaling,feedback]
[--feedback-repeats R]``

The parameter tree has the shapes of kuangliu's CIFAR ResNet-18 in Flax layout (11,173,962
parameters; conv kernels ``[kh, kw, in, out]``, BatchNorm scales and biases, a 512x10 head).
Each worker holds its own random gradient; a *step* is ``tx.update`` of
``optax.chain(reducer, optax.sgd(0.1, momentum=0.9))`` inside ``shard_map`` over W fake CPU
devices, i.e. compression, the collectives and decoding (no model forward/backward).

Two tables:

1. W workers (default 8), every codec (with error feedback) against the dense ``pmean``:
   ``hlo_bytes_per_step`` is what the HLO meter reads (per-device collective operand bytes)
   and must equal the transform's own ``bytes_sent`` (for Accordion the meter adds up both
   modes' branches; ``bytes_sent`` is the mode in use); ``step_time_s`` and
   ``dense_step_time_s`` are medians measured round-robin in the same run. 1-D parameters
   (BatchNorm) are averaged dense, as in the reference. Exact TopK's time is mostly the
   sender's ``lax.top_k`` (slow on CPU for large K); the blockwise row is the fast mode.
   Receivers decode the gathered payloads with the codec's fused ``decode_sum``.
2. Bytes per worker at 2, 4 and 8 workers for the ``all_gather`` and ``two_phase`` paths.
   ``traffic_bytes_per_worker`` is what one worker *receives* under the usual algorithms
   (ring all-gather: ``(W-1)`` operands; all-to-all: ``(W-1)/W`` of the operand; ring
   all-reduce: ``2 (W-1)/W`` of the operand): all-gather traffic grows linearly with W,
   two-phase stays flat.

3. ``feedback``: what error feedback costs. An MLP of 4,197,376 parameters (1024-2048-1024,
   two weight matrices and their biases), 2 workers; each row times the reducer alone (``tx.update``
   of ``compressed_mean`` inside ``shard_map``, state donated as in a training step), every row
   round-robin in one run; ``step_time_s`` is the median and ``step_time_q1_s``/``step_time_q3_s``
   the interquartile range. ``ratio_to_plain`` is a ``+ef``/``+ef21`` row's median over the same
   codec's without feedback. ``minor_faults_per_step`` counts the process's minor page faults per
   timed call (``getrusage``): the CPU backend takes a program's temporaries from the host
   ``malloc`` on every call (``jaxcomp._cpu`` [malloc]), and glibc may hand back fresh pages each
   time (a fault per 4 KiB touched).

On the CPU backend a 16-bit ``psum`` travels as ``float32`` (JAX-NOTES §2): the ``cast``
row on the ``psum`` path shows twice its payload; its ``two_phase`` row keeps ``u16``.
"""

from __future__ import annotations

import math

from jaxcomp._cpu import HostMalloc
from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import compressors  # noqa: E402
from jaxcomp import feedback  # noqa: E402
from jaxcomp import transforms  # noqa: E402
from jaxcomp.bench._dp_feedback import feedback_table  # noqa: E402, F401 (re-exported)
from jaxcomp.bench._dp_feedback import mlp_shapes  # noqa: E402, F401
from jaxcomp.bench._dp_feedback import run_feedback  # noqa: E402
from jaxcomp.bench._dp_step import _Step  # noqa: E402
from jaxcomp.bench._dp_step import worker_grads  # noqa: E402

RESNET18_PARAMS = 11_173_962
_RING = {  # bytes one worker receives, per operand byte, for group size w
    "all-gather": lambda w: w - 1,
    "all-to-all": lambda w: (w - 1) / w,
    "all-reduce": lambda w: 2 * (w - 1) / w,
    "reduce-scatter": lambda w: (w - 1) / w,
    "collective-permute": lambda w: 1,
    "collective-broadcast": lambda w: 1,
}


def resnet18_shapes(num_classes: int = 10) -> dict:
    """kuangliu CIFAR ResNet-18 parameter shapes (Flax layout) as ``ShapeDtypeStruct``s."""
    f32 = jnp.float32

    def conv(k, cin, cout):
        return jax.ShapeDtypeStruct((k, k, cin, cout), f32)

    def bn(c):
        return {"scale": jax.ShapeDtypeStruct((c,), f32), "bias": jax.ShapeDtypeStruct((c,), f32)}

    tree = {"conv1": conv(3, 3, 64), "bn1": bn(64)}
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            name = f"layer{stage}_{block}"
            stride = 2 if (block == 0 and stage > 1) else 1
            blk = {
                "conv1": conv(3, cin, cout),
                "bn1": bn(cout),
                "conv2": conv(3, cout, cout),
                "bn2": bn(cout),
            }
            if stride != 1 or cin != cout:
                blk["shortcut"] = conv(1, cin, cout)
                blk["shortcut_bn"] = bn(cout)
            tree[name] = blk
            cin = cout
    tree["linear"] = {
        "kernel": jax.ShapeDtypeStruct((512, num_classes), f32),
        "bias": jax.ShapeDtypeStruct((num_classes,), f32),
    }
    return tree


def codec_table() -> list[tuple[str, str, object]]:
    """(label, path, reducer factory) of the W-worker table."""
    ef = feedback.error_feedback
    c = compressors
    return [
        ("dense_pmean", "dense", lambda: transforms.compressed_mean(c.identity(), path="dense")),
        ("power_sgd_r1", "codec", lambda: transforms.compressed_mean(ef(c.power_sgd(1)))),
        ("power_sgd_r2", "codec", lambda: transforms.compressed_mean(ef(c.power_sgd(2)))),
        ("power_sgd_r4", "codec", lambda: transforms.compressed_mean(ef(c.power_sgd(4)))),
        ("top_k_10%", "all_gather", lambda: transforms.compressed_mean(ef(c.top_k(0.1)))),
        ("top_k_1%", "all_gather", lambda: transforms.compressed_mean(ef(c.top_k(0.01)))),
        (
            "top_k_10%_blockwise",
            "all_gather",
            lambda: transforms.compressed_mean(ef(c.top_k(0.1, method="blockwise"))),
        ),
        ("quantize_8", "all_gather", lambda: transforms.compressed_mean(ef(c.quantize(8)))),
        ("quantize_4", "all_gather", lambda: transforms.compressed_mean(ef(c.quantize(4)))),
        ("sign", "all_gather", lambda: transforms.compressed_mean(ef(c.sign()))),
        ("rand_k_10%", "psum", lambda: transforms.compressed_mean(ef(c.rand_k(0.1)))),
        ("cast_bf16", "psum", lambda: transforms.compressed_mean(c.cast("bfloat16"))),
        (
            "cast_bf16",
            "two_phase",
            lambda: transforms.compressed_mean(c.cast("bfloat16"), path="two_phase"),
        ),
        (
            "quantize_8",
            "two_phase",
            lambda: transforms.compressed_mean(ef(c.quantize(8)), path="two_phase"),
        ),
        (
            "accordion_psgd_r2/r1",
            "codec(low)",
            lambda: transforms.accordion(interval_steps=10**6),  # stays in its first interval
        ),
    ]


def scaling_table() -> list[tuple[str, str, object]]:
    ef = feedback.error_feedback
    c = compressors
    rows = []
    for label, codec in (("quantize_8", c.quantize(8)), ("top_k_10%", c.top_k(0.1))):
        for path in ("all_gather", "two_phase"):
            rows.append(
                (
                    label,
                    path,
                    lambda codec=codec, path=path: transforms.compressed_mean(ef(codec), path=path),
                )  # fmt: skip
            )
    return rows


def traffic(report: comm.CollectiveReport) -> float:
    """Bytes one worker receives under ring/pairwise algorithms (see the module docstring)."""
    return float(
        sum(r.total_bytes * _RING[r.kind](r.group_size) for r in report.records if r.kind in _RING)
    )


def _bytes_sent(opt_state) -> float:
    leaves = jax.tree.leaves(
        opt_state,
        is_leaf=lambda n: isinstance(
            n, (transforms.CompressedMeanState, transforms.AccordionState)
        ),
    )
    (state,) = [
        s
        for s in leaves
        if isinstance(s, (transforms.CompressedMeanState, transforms.AccordionState))
    ]
    return float(state.bytes_sent)


def run(
    workers: int, repeats: int, scaling: tuple[int, ...], only: tuple[str, ...] = ()
) -> list[dict]:
    params = resnet18_shapes()
    num = sum(math.prod(s.shape) for s in jax.tree.leaves(params))
    assert num == RESNET18_PARAMS, num
    dense_bytes = 4 * num
    results = []
    rows = codec_table() if workers else []
    if rows:
        mesh = comm.make_mesh([(comm.DATA, workers)], devices=jax.devices()[:workers])
        grads = worker_grads(params, mesh)
        dense = _Step(rows[0][2](), params, mesh)
    for label, path, make in rows:
        if only and label != "dense_pmean" and not any(label.startswith(o) for o in only):
            continue
        step = dense if label == "dense_pmean" else _Step(make(), params, mesh)
        report = comm.measure_collectives(step.fn, *step.args(grads))
        _, new_state = step.fn(*step.args(grads))
        sent = _bytes_sent(new_state)
        if step is dense:
            (t,) = _common.time_interleaved([(dense.fn, dense.args(grads))], repeats=repeats)
            t_dense = t
        else:
            t, t_dense = _common.time_interleaved(
                [(step.fn, step.args(grads)), (dense.fn, dense.args(grads))], repeats=repeats
            )
        hlo = report.total_bytes  # Accordion: both modes' branches, each counted once
        results.append(
            {
                "table": "codecs",
                "codec": label,
                "path": path,
                "workers": workers,
                "hlo_bytes_per_step": hlo,
                "bytes_sent_metric": sent,
                "dense_bytes_per_step": dense_bytes,
                "compression": dense_bytes / sent,
                "traffic_bytes_per_worker": traffic(report),
                "step_time_s": t,
                "dense_step_time_s": t_dense,
                "time_ratio_to_dense": t / t_dense,
                "dtypes": sorted(report.dtypes()),
            }
        )
        print(f"  {label:22s} {path:14s} {hlo:12.0f} B  {t * 1e3:9.1f} ms", flush=True)
        del step

    for w in scaling:
        mesh = comm.make_mesh([(comm.DATA, w)], devices=jax.devices()[:w])
        grads = worker_grads(params, mesh, seed=1)
        for label, path, make in scaling_table():
            step = _Step(make(), params, mesh)
            report = comm.measure_collectives(step.fn, *step.args(grads))
            results.append(
                {
                    "table": "scaling",
                    "codec": label,
                    "path": path,
                    "workers": w,
                    "hlo_bytes_per_step": report.total_bytes,
                    "dense_bytes_per_step": dense_bytes,
                    "traffic_bytes_per_worker": traffic(report),
                    "step_time_s": None,
                    "dense_step_time_s": None,
                }
            )
            print(f"  W={w} {label:12s} {path:11s} traffic {traffic(report):12.0f} B", flush=True)
    return results


def main(argv: list[str] | None = None, host_malloc: HostMalloc | None = None) -> int:
    p = _common.parser(__doc__, __name__)
    p.set_defaults(repeats=5)
    p.add_argument("--workers", type=int, default=8, help="workers of the codec table")
    p.add_argument("--scaling", default="2,4,8", help="worker counts of the scaling table")
    p.add_argument("--only", default="", help="comma-separated codec label prefixes to run")
    p.add_argument(
        "--tables", default="codecs,scaling,feedback", help="tables to run (comma-separated)"
    )
    p.add_argument("--feedback-repeats", type=int, default=40, help="timings per feedback row")
    args = p.parse_args(argv)
    tables = set(args.tables.split(","))
    scaling = tuple(int(w) for w in args.scaling.split(",") if w) if "scaling" in tables else ()
    only = tuple(o for o in args.only.split(",") if o)
    workers = args.workers if "codecs" in tables else 0
    results = run(workers, args.repeats, scaling, only)
    if "feedback" in tables:
        results += run_feedback(args.feedback_repeats)
    codecs = [r for r in results if r["table"] == "codecs"]
    print()
    _common.print_table(
        codecs or [{}],
        [
            ("codec", "s"),
            ("path", "s"),
            ("hlo_bytes_per_step", ".0f"),
            ("bytes_sent_metric", ".0f"),
            ("compression", ".1f"),
            ("traffic_bytes_per_worker", ".0f"),
            ("step_time_s", ".4f"),
            ("dense_step_time_s", ".4f"),
            ("time_ratio_to_dense", ".2f"),
        ],
    )
    scaled = [r for r in results if r["table"] == "scaling"]
    print()
    _common.print_table(
        scaled or [{}],
        [
            ("codec", "s"),
            ("path", "s"),
            ("workers", "d"),
            ("hlo_bytes_per_step", ".0f"),
            ("traffic_bytes_per_worker", ".0f"),
        ],
    )
    fed = [r for r in results if r["table"] == "feedback"]
    print()
    _common.print_table(
        fed or [{}],
        [
            ("codec", "s"),
            ("step_time_s", ".4f"),
            ("step_time_q1_s", ".4f"),
            ("step_time_q3_s", ".4f"),
            ("ratio_to_plain", ".2f"),
            ("minor_faults_per_step", ".0f"),
        ],
    )
    widened = ("cast_bf16", "psum")  # CPU backend: the 16-bit all-reduce runs in f32
    bad = [
        r["codec"]
        for r in codecs
        if not r["codec"].startswith("accordion")
        and (r["codec"], r["path"]) != widened
        and r["hlo_bytes_per_step"] != r["bytes_sent_metric"]
    ]
    if bad:
        print(f"HLO bytes differ from the transform's bytes_sent for: {bad}")
    _common.write_json(
        args.json,
        "data_parallel",
        results,
        resnet18_params=RESNET18_PARAMS,
        host_malloc=host_malloc,
    )
    return 1 if bad else 0
