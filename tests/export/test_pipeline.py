"""Pipeline ``step`` (compressed and dense) and ``evaluate`` lower for cuda and tpu for each link
kind and schedule, with the compressed payloads on the sends and every branch uniform over the
stage axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp._bits import byte_size

pytestmark = pytest.mark.usefixtures("fast_compiles")

S, M, MB, D = 3, 3, 2, 16  # 3 stages: a first, a middle and a last, every role a link end has
N = M * MB
ACTIVATION = f"tensor<{MB}x{D}xf32>"  # one microbatch's activation, uncompressed

LINKS = {
    "identity": pipeline.link(),
    "topk_ef": pipeline.link(
        F.error_feedback(C.top_k(0.25, per_sample=True)), F.error_feedback(C.top_k(0.5))
    ),
    "quantize4": pipeline.link(
        C.quantize(4, scale="feature"), C.quantize(4, rounding="stochastic")
    ),
    "shared_mask": pipeline.link(C.top_k(0.25, per_sample=True), mode="shared_mask"),
    "ef21_bf16": pipeline.link(F.ef21(C.top_k(0.25)), F.ef21(C.cast("bfloat16"))),
    "aq_sgd": pipeline.link(
        F.aq_sgd(C.quantize(4), N), F.error_feedback(C.top_k(0.5), num_samples=N)
    ),
}
SCHEDULES = tuple(getattr(pipeline, "SCHEDULES", ("gpipe",)))
#: every link under GPipe; under the other schedules, the links whose state lives from a
#: microbatch's forward to its backward (AQ-SGD's per-sample caches and its EF backward, the
#: shared mask): a payload's types are the link's, whatever the schedule; what a schedule
#: changes is when the sends happen and which branch each stage takes
RUNS = [(n, "gpipe") for n in sorted(LINKS)] + [
    (n, s) for s in SCHEDULES if s != "gpipe" for n in ("aq_sgd", "shared_mask")
]


def _stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _mse(y, labels):
    return jnp.mean((y - labels) ** 2)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    params = [
        {"w": jnp.asarray(rng.normal(size=(D, D)) / 4, jnp.float32), "b": jnp.zeros((D,))}
        for _ in range(S)
    ]
    batch = {
        "x": jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
        "label": jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
        "ids": jnp.arange(N, dtype=jnp.int32),
    }
    mesh = pipeline.pipeline_mesh(S, jax.devices()[:S])
    packed = pipeline.pack_params(params, NamedSharding(mesh, P("stage")))
    model = pipeline.StagedModel((_stage,) * S, _mse)
    return mesh, model, packed, batch


def _payload_sends(channel, lowering):
    """The types a boundary's compressed payload crosses as: its one array (8- and 16-bit
    floats as their bits), or, with several arrays (codes and scales), one ``uint8`` vector of
    their bytes (every boundary here sends the same payload: no padding)."""
    like = jax.ShapeDtypeStruct((MB, D), jnp.float32)
    payload = C.payload_shape(F.as_channel(channel).codec, like)
    leaves = jax.tree.leaves(payload)
    if len(leaves) > 1:
        return {lowering.tensor_type((byte_size(payload),), jnp.uint8)}
    (leaf,) = leaves
    dtype = {2: jnp.uint16, 1: jnp.uint8}.get(leaf.dtype.itemsize)
    if not jnp.issubdtype(leaf.dtype, jnp.floating) or dtype is None:
        dtype = leaf.dtype
    return {lowering.tensor_type(leaf.shape, dtype)}


def _export_uniform(fn, *args, mesh, lowering):
    """``lowering.export`` and ``lowering.uniform`` of one ``jax.jit(fn)``, traced once (the
    export's trace is the jit's cached one)."""
    with jax.set_mesh(mesh):
        jitted = jax.jit(fn)
        comm.check_collective_uniformity(jitted.trace(*args))
        exported = jax.export.export(jitted, platforms=lowering.platforms)(*args)
    assert exported.platforms == lowering.platforms
    return [t for k, t in lowering.collectives(exported) if k == "collective_permute"]


@pytest.mark.slow
@pytest.mark.parametrize("name, schedule", RUNS)
def test_pipeline_step_and_evaluate_export(name, schedule, setup, lowering):
    mesh, model, packed, batch = setup
    link = LINKS[name]
    kwargs = {} if schedule == "gpipe" else {"schedule": schedule}
    pipe = pipeline.distribute(model, pipeline.PipelineConfig(M, link, **kwargs), mesh)
    states = pipe.init(packed, batch)
    key = jax.random.key(0)
    sends = {}
    for compress in (True, False):

        def step(packed, batch, states, key, compress=compress):
            return pipe.step(packed, batch, states, key, compress=compress)

        sends[compress] = _export_uniform(
            step, packed, batch, states, key, mesh=mesh, lowering=lowering
        )

    def evaluate(packed, batch, key):
        return pipe.evaluate(packed, batch, key, compress=True)

    eval_sends = _export_uniform(evaluate, packed, batch, key, mesh=mesh, lowering=lowering)

    assert ACTIVATION in sends[False]  # compress=False sends dense
    got = set(sends[True])
    assert _payload_sends(link.forward, lowering) <= got, sends[True]
    if link.backward is not None:
        assert _payload_sends(link.backward, lowering) <= got, sends[True]
    if name == "identity":
        assert ACTIVATION in sends[True] and ACTIVATION in eval_sends
    else:
        assert ACTIVATION not in sends[True], sends[True]
        assert ACTIVATION not in eval_sends, eval_sends
