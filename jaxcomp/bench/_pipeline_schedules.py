"""The pipeline benchmark's schedule part: GPipe vs 1F1B, memory and time against ``M``.

For a heterogeneous 4-stage CNN and a 4-block GPT decoder (from :func:`jaxcomp.models.get_model`)
on ``S = 4`` fake CPU devices, every ``(schedule, M)`` for ``M`` in ``microbatches`` (and per-stage
``jax.checkpoint`` where ``checkpoint`` is set) records:

* ``peak_bytes``: the compiled step's memory analysis per device, temp + arguments + outputs
  (``temp_bytes``, ``argument_bytes``, ``output_bytes`` separately);
* ``ideal_activation_bytes``: over the stages, one stage's saved residuals per microbatch times
  the microbatches alive on it (``Pipeline.memory``), and ``residual_buffer_bytes``, what each
  device allocates for them (ring rows as large as the largest stage's);
* ``step_time_s`` of the compressed step (TopK 10% + EF forward, 8-bit backward) and
  ``identity_step_time_s`` of the same schedule with identity links, measured round-robin
  (median, ``*_q1`` / ``*_q3`` the interquartile range);
* ``hlo_bytes_per_step``: the step's ``collective-permute`` bytes (the boundary sends);
  ``data_hlo_bytes_per_step``: bytes of the collectives over ``data`` (0 on a stage-only
  mesh; the :func:`replica_records` measure them on a ``data`` 2 x ``stage`` 4 mesh);
* ``link_state_bytes_per_device`` (an AQ-SGD link's packed row per device) against
  ``live_link_state_bytes`` (the largest device's own ends).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import models
from jaxcomp import pipeline
from jaxcomp import transforms
from jaxcomp.bench import _common


def _conv(p, x, stride=1):
    y = jax.lax.conv_general_dilated(
        x, p["kernel"], (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + p["bias"]


def _stem(p, x):  # [mb, 32, 32, 3] -> [mb, 32, 32, 16]
    return jax.nn.relu(_conv(p["conv"], x))


def _down(p, x):  # halves the resolution, doubles the channels
    return jax.nn.relu(_conv(p["conv"], x, stride=2)) * p["scale"]


def _head(p, x):  # [mb, 8, 8, 64] -> [mb, 10]
    return jax.nn.relu(x.mean(axis=(1, 2)) @ p["w1"]) @ p["w2"]


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn(rows: int, seed: int = 0):
    """A heterogeneous CNN (channels 3 -> 16 -> 32 -> 64 -> 10, resolution 32 -> 16 -> 8):
    ``(model, params, batch)``."""
    rng = np.random.default_rng(seed)

    def conv(cin, cout):
        w = rng.normal(size=(3, 3, cin, cout)) / np.sqrt(9 * cin)
        return {"kernel": jnp.asarray(w, jnp.float32), "bias": jnp.zeros((cout,))}

    params = [
        {"conv": conv(3, 16)},
        {"conv": conv(16, 32), "scale": jnp.ones((32,))},
        {"conv": conv(32, 64), "scale": jnp.ones((64,))},
        {
            "w1": jnp.asarray(rng.normal(size=(64, 128)) / 8, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(128, 10)) / 11, jnp.float32),
        },
    ]
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, 32, 32, 3)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, size=(rows,)), jnp.int32),
        "ids": jnp.arange(rows, dtype=jnp.int32),
    }
    model = pipeline.StagedModel((_stem, _down, _down, _head), _cross_entropy)
    return model, params, batch


def gpt(rows: int, seed: int = 0):
    """A 4-block GPT decoder from the registry, one block per stage: ``(model, params, batch)``."""
    model = models.get_model(
        "gpt", vocab_size=256, seq_len=64, dim=128, num_blocks=4, num_heads=4,
        cuts=("block0", "block1", "block2"),
    )  # fmt: skip
    params = [v["params"] for v in model.init(jax.random.key(seed))]
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, size=(rows, 64)), jnp.int32)
    batch = {"x": tokens, "label": jnp.roll(tokens, -1, axis=1), "ids": jnp.arange(rows)}
    return model, params, batch


MODELS = {"cnn": cnn, "gpt": gpt}


def _compressed_link(num_samples: int) -> pipeline.Link:
    return pipeline.link(F.error_feedback(C.top_k(0.1, per_sample=True)), C.quantize(8))


def _memory(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    temp, args, out = m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes
    return dict(
        peak_bytes=float(temp + args + out),
        temp_bytes=float(temp),
        argument_bytes=float(args),
        output_bytes=float(out),
    )


def _compile(model, params, batch, mesh, config):
    pipe = pipeline.distribute(model, config, mesh)
    packed = pipeline.pack_params(params, NamedSharding(mesh, P(comm.STAGE)))
    args = (packed, batch, pipe.init(packed, batch), jax.random.key(0))
    return pipe, jax.jit(pipe.step).lower(*args).compile(), args


def _data_bytes(report: comm.CollectiveReport) -> float:
    """Bytes of the all-reduce / all-gather collectives over the 2-device ``data`` groups."""
    return float(
        sum(
            r.total_bytes
            for r in report.records
            if r.group_size == 2 and r.kind != "collective-permute"
        )
    )


def schedule_records(
    model_name: str,
    microbatches: tuple[int, ...] = (4, 8, 16, 32),
    microbatch_size: int = 8,
    repeats: int = 20,
    checkpoint: bool = False,
) -> list[dict]:
    """One record per ``(schedule, M)`` for ``model_name`` (see the module docstring)."""
    mesh = pipeline.pipeline_mesh(4, jax.devices()[:4])
    out = []
    for m in microbatches:
        rows = m * microbatch_size
        model, params, batch = MODELS[model_name](rows)
        batch = jax.device_put(batch, NamedSharding(mesh, P()))
        for schedule in pipeline.SCHEDULES:
            cfg = pipeline.PipelineConfig(
                m, _compressed_link(rows), schedule=schedule, checkpoint=checkpoint or None
            )
            pipe, step, args = _compile(model, params, batch, mesh, cfg)
            _, identity, id_args = _compile(
                model, params, batch, mesh, cfg._replace(links=pipeline.link())
            )
            times = _common.time_samples([(step, args), (identity, id_args)], repeats)
            t, t_id = (_common.spread(x) for x in times)
            plan = pipe.memory(args[0], batch)
            aq = pipeline.simulate(
                model, cfg._replace(links=pipeline.link(F.aq_sgd(C.quantize(4), rows)))
            ).memory(params, batch)
            report = comm.collective_report(step.as_text())
            rec = dict(
                benchmark="schedules",
                model=model_name,
                schedule=schedule,
                num_microbatches=m,
                microbatch_size=microbatch_size,
                stages=4,
                checkpoint=bool(checkpoint),
                **_memory(step),
                identity_peak_bytes=_memory(identity)["peak_bytes"],
                ideal_activation_bytes=float(plan["ideal_activation_bytes"]),
                residual_buffer_bytes=float(plan["residual_buffer_bytes"]),
                residual_bytes_per_stage=[float(b) for b in plan["residual_bytes_per_stage"]],
                in_flight=list(plan["in_flight"]),
                step_time_s=t["median"],
                step_time_q1=t["q1"],
                step_time_q3=t["q3"],
                identity_step_time_s=t_id["median"],
                identity_step_time_q1=t_id["q1"],
                identity_step_time_q3=t_id["q3"],
                hlo_bytes_per_step=float(report.bytes_by_kind().get("collective-permute", 0.0)),
                theory_bytes_per_step=float(pipe.bytes_per_step(params, batch)["wire_bytes"]),
                data_hlo_bytes_per_step=_data_bytes(report),
                link_state_bytes_per_device=float(aq["link_state_bytes"]),
                live_link_state_bytes=float(max(aq["live_link_state_bytes"])),
            )
            out.append(rec)
            print(
                f"  {model_name:4s} {schedule:5s} M={m:2d}{' ckpt' if checkpoint else ''}: "
                f"peak {rec['peak_bytes'] / 2**20:7.2f} MiB (temp {rec['temp_bytes'] / 2**20:6.2f}"
                f", ideal act. {rec['ideal_activation_bytes'] / 2**20:6.2f}), "
                f"{t['median'] * 1e3:7.2f} ms (identity {t_id['median'] * 1e3:7.2f} ms)"
            )
    return out


def replica_records(num_microbatches: int = 8, microbatch_size: int = 8, repeats: int = 10):
    """The CNN on ``data`` 2 x ``stage`` 4, 1F1B, compressed links, the replicas' gradients
    averaged by a float32 ``pmean`` and by PowerSGD rank 2 + EF: bytes per axis and time."""
    mesh = pipeline.pipeline_mesh(4)
    rows = 2 * num_microbatches * microbatch_size
    model, params, batch = cnn(rows)
    batch = jax.device_put(batch, NamedSharding(mesh, P(comm.DATA)))
    powersgd = transforms.compressed_mean(F.error_feedback(C.power_sgd(2)))
    calls, out = [], []
    for label, tx in (("pmean", None), ("power_sgd2+ef", powersgd)):
        cfg = pipeline.PipelineConfig(
            num_microbatches, _compressed_link(rows), schedule="1f1b", replica_mean=tx
        )
        pipe, step, args = _compile(model, params, batch, mesh, cfg)
        _, _, _, metrics = step(*args)
        report = comm.collective_report(step.as_text())
        calls.append((step, args))
        out.append(
            dict(
                benchmark="replicas",
                model="cnn",
                schedule="1f1b",
                num_microbatches=num_microbatches,
                replica_mean=label,
                **_memory(step),
                hlo_bytes_per_step=float(report.bytes_by_kind().get("collective-permute", 0.0)),
                theory_bytes_per_step=float(metrics["wire_bytes"]),
                dense_bytes_per_step=float(metrics["dense_bytes"]),
                data_hlo_bytes_per_step=_data_bytes(report),
                data_wire_bytes=float(metrics["data_wire_bytes"]),
                data_dense_bytes=float(metrics["data_dense_bytes"]),
            )
        )
    for rec, samples in zip(out, _common.time_samples(calls, repeats)):
        s = _common.spread(samples)
        rec.update(step_time_s=s["median"], step_time_q1=s["q1"], step_time_q3=s["q3"])
        print(
            f"  replicas {rec['replica_mean']:14s}: data axis {rec['data_hlo_bytes_per_step']:9.0f}"
            f" B (dense {rec['data_dense_bytes']:9.0f}), stage axis "
            f"{rec['hlo_bytes_per_step']:9.0f} B, {s['median'] * 1e3:7.2f} ms"
        )
    return out
