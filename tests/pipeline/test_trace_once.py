"""Every tick that runs a stage's op or a boundary's send reuses one trace of it
(``jaxcomp.pipeline._ticks.stage_ops``): a program traces each stage a fixed number of times,
however many microbatches (ticks) it has. Trace only, nothing compiled: each check is
milliseconds."""

import collections

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp.pipeline import _links


def _counting_mlp(tools, counts, num_microbatches):
    """The conftest MLP whose stage ``s`` adds one to ``counts[s]`` each time it is traced."""
    fx = tools.make_mlp(num_microbatches=num_microbatches)

    def stage(s):
        def f(p, x):
            counts[s] += 1
            return jnp.tanh(x @ p["w"] + p["b"])

        return f

    model = pipeline.StagedModel(tuple(stage(s) for s in range(4)), fx.model.loss_fn)
    return model, fx


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_each_stage_and_send_is_traced_once_per_program(
    tools, stage_mesh, schedule, num_microbatches, monkeypatch
):
    """Training: each stage 3 times (the residual plan, its forward, its backward), each
    boundary's encode and decode once per direction; evaluation: each stage once. Before the
    ops were shared, every tick traced them again (9 and 4 traces per stage)."""
    counts, sends = collections.Counter(), collections.Counter()
    for name in ("forward_halves", "backward_halves"):
        original = getattr(_links, name)

        def counted(lk, b, *args, _name=name, _original=original):
            sends[_name, b] += 1
            return _original(lk, b, *args)

        monkeypatch.setattr(_links, name, counted)
    model, fx = _counting_mlp(tools, counts, num_microbatches)
    link = pipeline.link(C.quantize(8), C.quantize(8))
    config = pipeline.PipelineConfig(num_microbatches, link, schedule=schedule)
    pipe = pipeline.distribute(model, config, stage_mesh)
    params = pipeline.pack_params(fx.params, NamedSharding(stage_mesh, P("stage")))
    states = pipe.init(params, fx.batch)
    counts.clear()
    jax.jit(pipe.step).trace(params, fx.batch, states, jax.random.key(0))
    assert dict(counts) == {s: 3 for s in range(4)}
    assert dict(sends) == {
        (n, b): 2 for n in ("forward_halves", "backward_halves") for b in range(3)
    }
    counts.clear()
    sends.clear()
    jax.jit(pipe.evaluate, static_argnames="compress").trace(params, fx.batch, compress=True)
    assert dict(counts) == {s: 1 for s in range(4)}
    assert dict(sends) == {("forward_halves", b): 2 for b in range(3)}
