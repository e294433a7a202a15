"""The registry's NNX model in the trainer: the pipeline mode trains it, its optimizer (LAMB's
per-leaf trust ratios) on each stage's parameters by name."""

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _trainer

pytestmark = pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")


@pytest.mark.slow  # a pipeline-mode setup; the NNX stages are in tests/pipeline
def test_nnx_mlp_trains_in_pipeline_mode_with_a_per_leaf_optimizer(make_config):
    config = make_config(
        mode="pipeline",
        mesh=[("stage", 2)],  # fc1 | head
        model_name="nnx_mlp",
        model={"hidden": (16,)},
        batch_size=32,
        eval_batch_size=32,
        optax_name="lamb",
        lr=1e-2,
        grad_clip_norm=1.0,
        pipeline={"num_microbatches": 2, "forward": {"name": "quantize", "bits": 8}},
    )
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    assert sorted(state.params.unpack()[0]["fc1"]["linear"]) == ["bias", "kernel"]
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    batch = _trainer.place(batch, s.mode.batch_sharding)
    key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(0))), s.mesh)
    losses = []
    for step in range(4):
        state, metrics = s.mode.train_step(state, batch, key, step)
        assert int(metrics["finite"]) == 1
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    sums = s.mode.eval_step(state, batch, False)
    assert float(sums["count"]) == 32
