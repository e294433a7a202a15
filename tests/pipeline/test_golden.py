"""The compact link-state layout and the explicit schedules give the numbers the pipeline gave
before them (recorded by ``_golden.py`` at commit 7c1e877): loss, gradients and every live
link end, after warm-up and compressed steps, on a stage mesh and with two data replicas."""

import importlib.util
import pathlib

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline

_spec = importlib.util.spec_from_file_location(
    "_golden", pathlib.Path(__file__).with_name("_golden.py")
)
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)
CASES = golden.cases()


# every case under 1F1B; the replicas under GPipe too (without replicas, gpipe == 1f1b ==
# simulate with compressed links, AQ-SGD's included: test_compressed.py). ``aq_sgd`` and
# ``quant_stochastic`` are checked against the recorded numbers in test_compressed.py's 1F1B
# run of the same link on the same MLP (its GOLDEN_CASES: one compile of their programs).
# ``topk_ef`` without replicas is not run: its link's numbers are pinned by
# ``replicas_topk_ef`` under both schedules, and one replica's == the simulation by
# test_compressed.py's topk_ef runs
NOT_HERE = ("aq_sgd", "quant_stochastic", "topk_ef")
RUNS = [(n, "1f1b") for n in sorted(CASES) if n not in NOT_HERE] + [("replicas_topk_ef", "gpipe")]


@pytest.mark.parametrize(
    "name, schedule",
    [r if r == ("ef21_q8", "1f1b") else pytest.param(*r, marks=pytest.mark.slow) for r in RUNS],
)
def test_same_numbers_as_before_the_compact_layout(name, schedule, recorded, tools):
    kind, link, compress_per_step, replicas = CASES[name]
    fx = golden.fixture(kind)
    mesh = pipeline.pipeline_mesh(golden.S, jax.devices()[: golden.S * replicas])
    config = pipeline.PipelineConfig(fx.M, link, schedule=schedule)
    pipe = pipeline.distribute(fx.model, config, mesh)
    params = pipeline.pack_params(fx.params, NamedSharding(mesh, P("stage")))
    batch = fx.batch
    if replicas > 1:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    states = pipe.init(params, batch)
    step = jax.jit(pipe.step, static_argnames="compress")
    for i, compress in enumerate(compress_per_step):
        loss, grads, states, metrics = step(params, batch, states, jax.random.key(i), compress)
        recorded.check(name, i, loss, grads, states, replicas)
        if not compress:
            _check_dense_step(fx, loss, grads, metrics, tools)


def _check_dense_step(fx, loss, grads, metrics, tools):
    """A dense step (AQ-SGD's warm-up: ``cnn_aq``, 1F1B on the 3-stage CNN, boundaries of two
    sizes) gives the unpipelined model's loss, gradients and metrics (identity links == the
    model: test_gpipe.py, on the MLP)."""
    tools.check_unpipelined(fx, loss, grads, metrics)


def test_every_recorded_case_is_checked(load_test_module):
    """A case this module does not run is checked in test_compressed.py's run of it (or, for
    ``topk_ef``, by ``replicas_topk_ef``): none drops out unseen."""
    compressed = load_test_module("pipeline/test_compressed.py")
    checked = {n for n, _ in RUNS} | set(compressed.GOLDEN_CASES.values()) | {"topk_ef"}
    assert checked == set(CASES)
    assert set(compressed.GOLDEN_CASES) <= set(compressed.RUNS)
