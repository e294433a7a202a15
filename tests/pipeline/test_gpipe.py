"""Identity links: both schedules equal the unpipelined model (value, gradient, outputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import models
from jaxcomp import pipeline
from jaxcomp.pipeline import _links
from jaxcomp.train import _mode


@pytest.mark.parametrize("form", ["packed", "list"])
def test_identity_mlp_matches_unpipelined(mlp, stage_mesh, pack, tools, form):
    """GPipe on 4 stages of one width; with packed parameters its sends are boundaries alike
    moved in one permute per tick and direction (jaxcomp.pipeline._ticks.move_boundaries)."""
    pipe = pipeline.distribute(mlp.model, pipeline.PipelineConfig(mlp.M), stage_mesh)
    params = pack(mlp.params) if form == "packed" else mlp.params
    states = pipe.init(params, mlp.batch)
    key = jax.random.key(0)
    compiled = jax.jit(pipe.step).lower(params, mlp.batch, states, key).compile()
    loss, grads, _, metrics = compiled(params, mlp.batch, states, key)
    ref_loss, ref_grads = tools.reference(mlp.model, mlp.params, mlp.batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    if form == "packed":
        assert isinstance(grads, pipeline.PackedParams)
        grads = grads.unpack()
        sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
        # 6 forward ticks send (1, 2, 3, 3, 2, 1 boundaries) and 6 backward: 24 sends in 12
        # permutes (test_ticks.py's _moves("gpipe", 4, 4)), each payload [2, 16] float32
        assert sent["permutes"] == 12
        assert sent["forward"] == sent["backward"] == mlp.M * 3 * 2 * 16 * 4
    assert isinstance(grads, (list, tuple)) and len(grads) == 4
    tools.close(list(grads), ref_grads)


@pytest.fixture(scope="module")
def gpt():
    """A 1-block GPT decoder from the model registry, cut after the block: 2 stages (4 blocks on
    4 stages compiled a 3.8 s step for the same property)."""
    model = models.get_model(
        "gpt", vocab_size=32, seq_len=8, dim=16, num_blocks=1, num_heads=2, cuts=("block0",)
    )
    params = [v["params"] for v in _mode.jit_init(model.init)(jax.random.key(0))]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, size=(8, 8)), jnp.int32)
    return model, params, {"x": tokens, "label": jnp.roll(tokens, -1, axis=1)}


@pytest.mark.slow  # the GPT decoder and its reference, two programs
def test_identity_gpt_decoder_from_the_registry_equals_unpipelined(gpt, pack, tools):
    """``models.get_model`` feeds the pipeline as it is (one StagedModel class). One schedule:
    that every schedule equals the unpipelined model is the MLP's tests here and the CNN's
    1F1B dense step in test_golden.py (``cnn_aq``'s warm-up)."""
    model, params, batch = gpt
    assert isinstance(model, pipeline.StagedModel) and models.StagedModel is pipeline.StagedModel
    ref_loss, ref_grads = tools.reference(model, params, batch)
    mesh = pipeline.pipeline_mesh(2, jax.devices()[:2])
    packed = pack(params, mesh)
    pipe = pipeline.distribute(model, pipeline.PipelineConfig(2, schedule="1f1b"), mesh)
    loss, grads, _, _ = jax.jit(pipe.step)(packed, batch, pipe.init(packed, batch), None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(grads.unpack(), ref_grads, rtol=1e-4, atol=1e-6)


def test_identity_with_data_axis_on_an_explicit_mesh_matches_unpipelined(tools):
    mlp = tools.make_mlp(microbatch=2)
    mesh = jax.make_mesh((2, 4), (comm.DATA, comm.STAGE))  # Explicit axes, 2 replicas
    local = {k: jnp.concatenate([v, v[::-1]]) for k, v in mlp.batch.items()}  # 2 x 8 rows
    batch = jax.device_put(local, NamedSharding(mesh, P(comm.DATA)))
    config = pipeline.PipelineConfig(mlp.M, schedule="1f1b")
    pipe = pipeline.distribute(mlp.model, config, mesh)
    states = pipe.init(mlp.params, batch)
    loss, grads, _, _ = jax.jit(pipe.step)(mlp.params, batch, states, jax.random.key(0))
    ref_loss, ref_grads = tools.reference(mlp.model, mlp.params, local)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(list(grads), ref_grads)
