"""The ``feedback`` table of ``bench data_parallel``: what error feedback costs (see
:mod:`jaxcomp.bench.data_parallel`, table 3)."""

from __future__ import annotations

import math
import resource

from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import compressors  # noqa: E402
from jaxcomp import feedback  # noqa: E402
from jaxcomp import transforms  # noqa: E402
from jaxcomp.bench._dp_step import _Step  # noqa: E402
from jaxcomp.bench._dp_step import worker_grads  # noqa: E402


def feedback_table() -> list[tuple[str, str, object]]:
    """(label, label of the same codec without feedback, reducer factory) of the EF table."""
    ef, ef21 = feedback.error_feedback, feedback.ef21
    c = compressors
    rows = [("dense_pmean", "", lambda: transforms.compressed_mean(c.identity(), path="dense"))]
    for label, make in (
        ("power_sgd_r2", lambda: c.power_sgd(2)),
        ("top_k_1%", lambda: c.top_k(0.01)),
        ("top_k_1%_blockwise", lambda: c.top_k(0.01, method="blockwise")),
        ("quantize_8", lambda: c.quantize(8)),
    ):
        wraps = [("", lambda codec: codec), ("+ef", ef)]
        if label.startswith("top_k_1%"):
            wraps.append(("+ef21", ef21))
        for suffix, wrap in wraps:
            rows.append(
                (
                    label + suffix,
                    label if suffix else "",
                    lambda make=make, wrap=wrap: transforms.compressed_mean(wrap(make())),
                )
            )
    return rows


def mlp_shapes() -> dict:
    """An MLP 1024-2048-1024 (4,197,376 float32 parameters) as ``ShapeDtypeStruct``s."""
    f32 = jnp.float32
    return {
        "w1": jax.ShapeDtypeStruct((1024, 2048), f32),
        "b1": jax.ShapeDtypeStruct((2048,), f32),
        "w2": jax.ShapeDtypeStruct((2048, 1024), f32),
        "b2": jax.ShapeDtypeStruct((1024,), f32),
    }


def run_feedback(repeats: int, workers: int = 2) -> list[dict]:
    """The ``feedback`` table (see the module docstring)."""
    params = mlp_shapes()
    mesh = comm.make_mesh([(comm.DATA, workers)], devices=jax.devices()[:workers])
    grads = worker_grads(params, mesh, seed=2)
    rows = feedback_table()
    steps = [_Step(make(), params, mesh, optimizer=False, donate=True) for _, _, make in rows]
    calls = [s.threaded(grads) for s in steps]
    for call in calls:  # compile-time and first-call allocations are not counted below
        jax.block_until_ready(call())
    faults = [[0, 0] for _ in calls]  # minor page faults, calls

    def counted(i):
        def call():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out = jax.block_until_ready(calls[i]())
            faults[i][0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            faults[i][1] += 1
            return out

        return call

    load_before = _common.load_average()
    samples = _common.time_samples([(counted(i), ()) for i in range(len(calls))], repeats)
    load_after = _common.load_average()
    results, medians = [], {}
    for (label, plain, _), times, (num_faults, num_calls) in zip(rows, samples, faults):
        stats = _common.spread(times)
        medians[label] = stats["median"]
        results.append(
            {
                "table": "feedback",
                "codec": label,
                "workers": workers,
                "params": sum(math.prod(s.shape) for s in jax.tree.leaves(params)),
                "step_time_s": stats["median"],
                "step_time_q1_s": stats["q1"],
                "step_time_q3_s": stats["q3"],
                "ratio_to_plain": stats["median"] / medians[plain] if plain else None,
                "minor_faults_per_step": num_faults / num_calls,
                "repeats": repeats,
                "load_before": load_before,
                "load_after": load_after,
            }
        )
        ratio = f"  x{results[-1]['ratio_to_plain']:.2f}" if plain else ""
        print(
            f"  {label:24s} {stats['median'] * 1e3:8.2f} ms  "
            f"[{stats['q1'] * 1e3:.2f}, {stats['q3'] * 1e3:.2f}]  "
            f"faults/step {num_faults / num_calls:7.0f}{ratio}",
            flush=True,
        )
    return results
