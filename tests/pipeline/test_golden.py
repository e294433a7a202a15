"""The compact link-state layout and the explicit schedules give the numbers the pipeline gave
before them (recorded by ``_golden.py`` at commit 7c1e877): loss, gradients and every live
link end, after warm-up and compressed steps, on a stage mesh and with two data replicas."""

import importlib.util
import pathlib

import jax
import numpy as np
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


@pytest.fixture(scope="module")
def recorded():
    with np.load(golden.GOLDEN) as f:
        return dict(f)


def _ends(states, replica):
    out = []
    for st in states.ends(replica):
        for ends in (st.forward, st.backward):
            out += [np.asarray(a) for a in jax.tree.leaves(ends.send)]
            out += [np.asarray(a) for a in jax.tree.leaves(ends.recv)]
    return out


# every case under 1F1B; the replicas under GPipe too (without replicas, gpipe == 1f1b ==
# simulate with compressed links, AQ-SGD's included: test_compressed.py). ``topk_ef`` without
# replicas is not run: its link's numbers are pinned by ``replicas_topk_ef`` under both
# schedules, and one replica's == the simulation by test_compressed.py's topk_ef runs
RUNS = [(n, "1f1b") for n in sorted(CASES) if n != "topk_ef"] + [("replicas_topk_ef", "gpipe")]


@pytest.mark.parametrize(
    "name, schedule",
    [r if r == ("ef21_q8", "1f1b") else pytest.param(*r, marks=pytest.mark.slow) for r in RUNS],
)
def test_same_numbers_as_before_the_compact_layout(name, schedule, recorded):
    kind, link, compress_per_step, replicas = CASES[name]
    fx = golden.fixture(kind)
    mesh = pipeline.pipeline_mesh(4, jax.devices()[: 4 * replicas])
    config = pipeline.PipelineConfig(fx.M, link, schedule=schedule)
    pipe = pipeline.distribute(fx.model, config, mesh)
    params = pipeline.pack_params(fx.params, NamedSharding(mesh, P("stage")))
    batch = fx.batch
    if replicas > 1:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    states = pipe.init(params, batch)
    step = jax.jit(pipe.step, static_argnames="compress")
    for i, compress in enumerate(compress_per_step):
        loss, grads, states, _ = step(params, batch, states, jax.random.key(i), compress)
        prefix = f"{name}/{i}"
        np.testing.assert_allclose(loss, recorded[f"{prefix}/loss"], rtol=1e-5)
        for j, g in enumerate(jax.tree.leaves(grads.unpack())):
            np.testing.assert_allclose(g, recorded[f"{prefix}/grad/{j}"], rtol=1e-5, atol=1e-6)
        for r in range(replicas):
            got = _ends(states, r if replicas > 1 else None)
            want = [recorded[k] for k in sorted(
                (k for k in recorded if k.startswith(f"{prefix}/ends/{r}/")),
                key=lambda k: int(k.rsplit("/", 1)[1]),
            )]  # fmt: skip
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
