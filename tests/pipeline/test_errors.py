"""Bad input raises a clear error before anything is compiled."""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline


@contextlib.contextmanager
def nothing_compiled():
    """Fails if XLA compiles anything inside the block."""
    events = []

    def listener(event, duration, **kwargs):
        del duration, kwargs
        if event.endswith("backend_compile_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        assert not events, "an error that should come first came after a compile"


def _raises(exc, match, fn, *args, **kwargs):
    with nothing_compiled(), pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_stage_count_must_divide_devices():
    _raises(ValueError, "num_stages=3 does not divide the 8 devices", pipeline.pipeline_mesh, 3)


def test_mesh_and_model_must_agree(mlp):
    mesh = pipeline.pipeline_mesh(2, jax.devices()[:2])
    _raises(ValueError, "'stage' axis has 2 devices; the model has 4 stages",
            pipeline.distribute, mlp.model, pipeline.PipelineConfig(4), mesh)  # fmt: skip


def test_fewer_microbatches_than_stages(mlp, stage_mesh):
    for build in (lambda c: pipeline.distribute(mlp.model, c, stage_mesh),
                  lambda c: pipeline.simulate(mlp.model, c)):  # fmt: skip
        _raises(ValueError, "num_microbatches must be >= the number of stages",
                build, pipeline.PipelineConfig(3))  # fmt: skip


def test_wrong_number_of_links(mlp):
    config = pipeline.PipelineConfig(4, (pipeline.link(),) * 2)
    _raises(ValueError, "one Link per boundary", pipeline.simulate, mlp.model, config)


def test_mismatched_boundary_shapes(mlp, stage_mesh):
    params = list(mlp.params)
    params[2] = {"w": jnp.ones((12, 16)), "b": jnp.ones(16)}  # stage 2 expects width 12
    pipe = pipeline.distribute(mlp.model, pipeline.PipelineConfig(4), stage_mesh)
    match = r"boundary shape mismatch: stage 2 cannot take stage 1's output float32\[2, 16\]"
    _raises(ValueError, match, pipe.init, params, mlp.batch)
    states = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4)).init(mlp.params, mlp.batch)
    _raises(ValueError, match, jax.jit(pipe.step), params, mlp.batch, states)


def test_stage_must_keep_the_microbatch_axis(mlp):
    model = mlp.model._replace(stages=(*mlp.model.stages[:3], lambda p, x: (x @ p["w"]).sum(0)))
    sim = pipeline.simulate(model, pipeline.PipelineConfig(4))
    _raises(ValueError, "stage 3 must keep the leading microbatch axis", sim.init,
            mlp.params, mlp.batch)  # fmt: skip


def test_aq_sgd_needs_sample_ids(mlp, stage_mesh):
    link = pipeline.link(F.aq_sgd(C.quantize(4), 8), C.quantize(8))
    pipe = pipeline.distribute(mlp.model, pipeline.PipelineConfig(4, link), stage_mesh)
    states = pipe.init(mlp.params, mlp.batch)
    no_ids = {k: v for k, v in mlp.batch.items() if k != "ids"}
    _raises(ValueError, "must carry the sample ids", jax.jit(pipe.step), mlp.params, no_ids,
            states)  # fmt: skip


def test_bad_batches(mlp):
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4))
    states = sim.init(mlp.params, mlp.batch)
    odd = {k: v[:6] for k, v in mlp.batch.items()}
    _raises(ValueError, "batch size 6 must be a positive multiple of 4", sim.step,
            mlp.params, odd, states)  # fmt: skip
    _raises(ValueError, "labels under one of", sim.step, mlp.params, {"x": mlp.batch["x"]},
            states)  # fmt: skip


def test_link_states_of_another_pipeline_or_batch(mlp):
    ef_link = pipeline.link(F.error_feedback(C.top_k(0.5)))
    ef = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4, ef_link))
    plain = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4))
    states = ef.init(mlp.params, mlp.batch)
    _raises(ValueError, "link_states do not match this pipeline's links", plain.step,
            mlp.params, mlp.batch, states)  # fmt: skip
    bigger = {k: jnp.concatenate([v, v]) for k, v in mlp.batch.items()}  # microbatches of 4
    _raises(ValueError, "initialise them for the same batch and microbatches", ef.step,
            mlp.params, bigger, states)  # fmt: skip


def test_shared_mask_needs_a_sparse_forward(mlp):
    link = pipeline.link(C.quantize(4), mode="shared_mask")
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4, link))
    _raises(ValueError, r"links\[0\]: mode='shared_mask' needs a forward codec", sim.init,
            mlp.params, mlp.batch)  # fmt: skip
    _raises(ValueError, "takes no backward channel", pipeline.link, C.top_k(0.1),
            C.quantize(8), mode="shared_mask")  # fmt: skip
    _raises(ValueError, "mode must be one of", pipeline.link, mode="shared")


def test_compress_must_be_static(mlp):
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4))
    states = sim.init(mlp.params, mlp.batch)
    _raises(TypeError, "mark it static", jax.jit(sim.step), mlp.params, mlp.batch, states,
            None, True)  # fmt: skip


def test_a_stochastic_link_needs_a_key(mlp):
    link = pipeline.link(C.top_k(0.5), C.quantize(4, rounding="stochastic"))
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(4, link))
    states = sim.init(mlp.params, mlp.batch)
    _raises(ValueError, r"links\[0\].backward uses the stochastic codec", jax.jit(sim.step),
            mlp.params, mlp.batch, states)  # fmt: skip


def test_gpipe_is_a_deprecated_alias_of_distribute(mlp, stage_mesh):
    config = pipeline.PipelineConfig(4, schedule="1f1b")
    with pytest.warns(DeprecationWarning, match="use pipeline.distribute"):
        old = pipeline.gpipe(mlp.model, config, stage_mesh)
    new = pipeline.distribute(mlp.model, config, stage_mesh)
    assert old.step.func is new.step.func and old.schedule == new.schedule == "1f1b"
    assert old.step.args[0]._replace(fns=None) == new.step.args[0]._replace(fns=None)
    assert "gpipe" not in pipeline.__all__
