"""Compressed links: distributed == simulated (loss, grads, link states over several steps),
and the bytes the compiled program sends == the theoretical payload bytes."""

import jax
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline

N = 8  # samples in the test batch (per-sample buffers)

LINKS = {
    "topk_ef": pipeline.link(
        F.error_feedback(C.top_k(0.25, per_sample=True)),
        F.error_feedback(C.top_k(0.5, per_sample=True)),
    ),
    "quantize4": pipeline.link(
        C.quantize(4, scale="feature"), C.quantize(4, rounding="stochastic")
    ),
    "shared_mask": pipeline.link(C.top_k(0.25, per_sample=True), mode="shared_mask"),
    "ef21_bf16": pipeline.link(F.ef21(C.top_k(0.25)), C.cast("bfloat16")),
    "aq_sgd": pipeline.link(
        F.aq_sgd(C.quantize(4), N), F.error_feedback(C.top_k(0.5), num_samples=N)
    ),
}
# AQ-SGD's first step is its uncompressed warm-up, which fills both per-sample caches
SCHEDULES = {"aq_sgd": (False, True, True)}


def _max_diff(a, b):
    return max(
        (float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
         zip(jax.tree.leaves(a), jax.tree.leaves(b))),
        default=0.0,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(LINKS))
def test_distributed_equals_simulated_and_sends_theory_bytes(name, mlp, stage_mesh, pack, tools):
    config = pipeline.PipelineConfig(mlp.M, LINKS[name])
    pipe = pipeline.gpipe(mlp.model, config, stage_mesh)
    sim = pipeline.simulate(mlp.model, config)
    step = jax.jit(pipe.step, static_argnames="compress")
    sim_step = jax.jit(sim.step, static_argnames="compress")
    params, packed = mlp.params, pack(mlp.params)
    states, sim_states = pipe.init(packed, mlp.batch), sim.init(params, mlp.batch)
    tools.close(states, sim_states, rtol=0, atol=0)
    measured = set()
    for i, compress in enumerate(SCHEDULES.get(name, (True, True))):
        key = jax.random.key(i)
        loss, grads, new_states, metrics = step(packed, mlp.batch, states, key, compress=compress)
        s_loss, s_grads, s_states, s_metrics = sim_step(
            params, mlp.batch, sim_states, key, compress=compress
        )
        np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
        tools.close(grads.unpack(), s_grads)
        tools.close(new_states, s_states)
        if jax.tree.leaves(states):
            assert _max_diff(new_states, states) > 0

        if compress not in measured:  # the program's sends, read from its compiled HLO
            measured.add(compress)
            counts = pipe.bytes_per_step(params, mlp.batch, compress=compress)
            assert counts == sim.bytes_per_step(params, mlp.batch, compress=compress)
            assert metrics["wire_bytes"] == counts["wire_bytes"] == s_metrics["wire_bytes"]
            report = comm.measure_collectives(step, packed, mlp.batch, states, key, compress)
            by_kind = report.bytes_by_kind()
            assert by_kind.pop("collective-permute") == counts["wire_bytes"]
            assert by_kind == {"all-reduce": 4.0}  # the loss: no dense fallback anywhere
            if compress:
                assert counts["wire_bytes"] < counts["dense_bytes"]
            else:
                assert counts["wire_bytes"] == counts["dense_bytes"]
                assert report.dtypes("collective-permute") == {"f32"}
        states, sim_states = new_states, s_states


def test_aq_sgd_warmup_fills_both_caches(mlp, stage_mesh, pack):
    """After the uncompressed warm-up, sender and receiver caches hold every sample's
    activation (in float16), bit-identical at both ends of each boundary."""
    config = pipeline.PipelineConfig(mlp.M, LINKS["aq_sgd"])
    sim = pipeline.simulate(mlp.model, config)
    states = sim.init(mlp.params, mlp.batch)
    _, _, states, _ = jax.jit(sim.step, static_argnames="compress")(
        mlp.params, mlp.batch, states, None, compress=False
    )
    h = mlp.batch["x"]
    for b, st in enumerate(states):
        h = mlp.model.stages[b](mlp.params[b], h)
        sent = np.asarray(st.forward.send.estimate[b])
        got = np.asarray(st.forward.recv.estimate[b + 1])
        np.testing.assert_array_equal(sent, got)
        np.testing.assert_allclose(sent, np.asarray(h, np.float16), rtol=1e-3, atol=1e-3)


def test_data_replicas_equal_per_replica_simulations(tools):
    """With a data axis, replica r runs the simulation of its half batch with key
    fold_in(key, r); gradients are their mean, link states are per replica."""
    mlp = tools.make_mlp(microbatch=4)
    mesh = pipeline.pipeline_mesh(4)  # 2 x 4
    config = pipeline.PipelineConfig(mlp.M, LINKS["topk_ef"])
    pipe, sim = pipeline.gpipe(mlp.model, config, mesh), pipeline.simulate(mlp.model, config)
    states = pipe.init(mlp.params, mlp.batch)
    key = jax.random.key(3)
    loss, grads, states, _ = jax.jit(pipe.step)(mlp.params, mlp.batch, states, key)
    half = mlp.batch["x"].shape[0] // 2
    sim_step = jax.jit(sim.step)
    outs = []
    for r in range(2):
        part = {k: v[r * half : (r + 1) * half] for k, v in mlp.batch.items()}
        outs.append(sim_step(mlp.params, part, sim.init(mlp.params, part),
                             jax.random.fold_in(key, r)))  # fmt: skip
    np.testing.assert_allclose(loss, (outs[0][0] + outs[1][0]) / 2, rtol=1e-5)
    tools.close(list(grads), jax.tree.map(lambda a, b: (a + b) / 2, outs[0][1], outs[1][1]))
    for r in range(2):
        tools.close(jax.tree.map(lambda a, r=r: a[:, r], states), outs[r][2])


def test_compressed_evaluation_matches_simulation(mlp, stage_mesh, pack, tools):
    """Evaluation with compression applies each forward codec alone; link states untouched."""
    config = pipeline.PipelineConfig(mlp.M, LINKS["topk_ef"])
    pipe, sim = pipeline.gpipe(mlp.model, config, stage_mesh), pipeline.simulate(mlp.model, config)
    evaluate = jax.jit(pipe.evaluate, static_argnames="compress")
    loss, metrics, out = evaluate(pack(mlp.params), mlp.batch, compress=True)
    s_loss, _, s_out = jax.jit(sim.evaluate, static_argnames="compress")(
        mlp.params, mlp.batch, compress=True
    )
    np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
    tools.close(out, s_out)
    dense_loss, _, dense_out = evaluate(pack(mlp.params), mlp.batch, compress=False)
    assert not np.allclose(np.asarray(out), np.asarray(dense_out))
    assert metrics["wire_bytes"] < metrics["dense_bytes"]
    ref_loss, _ = tools.reference(mlp.model, mlp.params, mlp.batch)
    np.testing.assert_allclose(dense_loss, ref_loss, rtol=1e-5)


def test_per_sample_buffers_are_updated_in_place(mlp, stage_mesh, pack):
    """AQ-SGD caches hold one row per sample of the dataset; a step touches only its rows, so
    its scratch memory must not scale with the cache (no whole-buffer copy per send)."""
    num_samples = 1 << 16
    cache_bytes = num_samples * 16 * 2  # [N, width] float16
    link = pipeline.link(F.aq_sgd(C.quantize(4), num_samples), C.quantize(8))
    config = pipeline.PipelineConfig(mlp.M, link)
    for pipe, params in (
        (pipeline.gpipe(mlp.model, config, stage_mesh), pack(mlp.params)),
        (pipeline.simulate(mlp.model, config), mlp.params),
    ):
        states = pipe.init(params, mlp.batch)
        compiled = (
            jax.jit(pipe.step, donate_argnums=2)
            .lower(params, mlp.batch, states, jax.random.key(0))
            .compile()
        )
        assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 2
