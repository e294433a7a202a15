"""Compressed replica averaging on a (data x stage) mesh: each stage device averages its own
stage's gradient over ``data`` with an optax transform, exactly as that transform applied by
hand to the replicas' gradients; the data-axis bytes are reported and are what the program
sends."""

import functools
import re
import types

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
from jaxcomp import transforms

STEPS = 2


def _power_sgd_ef():
    return transforms.compressed_mean(F.error_feedback(C.power_sgd(2)))


# each takes tests/transforms/test_user_protocol.py, whose majority_sign codec (signSGD with a
# majority vote, its own reduction protocol) is the user codec here too
TRANSFORMS = {
    "power_sgd_ef": lambda user: _power_sgd_ef(),
    "user_protocol_ef": lambda user: transforms.compressed_mean(
        F.error_feedback(user.majority_sign())
    ),
    "accordion": lambda user: transforms.accordion(
        C.power_sgd(2), C.power_sgd(1), interval_steps=1, check_every=1
    ),
}
LINK = pipeline.link(F.error_feedback(C.top_k(0.5, per_sample=True)), C.quantize(8))


@pytest.fixture(scope="module")
def setup(tools):
    """A 3-stage MLP (a first, a middle and a last stage) on a data 2 x stage 3 mesh."""
    mlp = tools.make_mlp(num_microbatches=3, microbatch=2, num_stages=3)
    batch = {k: jnp.concatenate([v, v[::-1]]) for k, v in mlp.batch.items()}  # 2 x 6 rows
    mesh = pipeline.pipeline_mesh(3, jax.devices()[:6])
    return mlp, batch, mesh


@pytest.fixture(scope="module")
def programs(setup):
    """The programs several tests run, compiled once for the module: the simulated step of the
    reference, jitted; ``distributed(name)``:
    the transform, its pipeline and its compiled step (the fast tier's HLO test and the slow
    tier's equivalence share PowerSGD's)."""
    mlp, batch, mesh = setup
    config = pipeline.PipelineConfig(mlp.M, LINK, schedule="1f1b")

    @functools.cache
    def distributed(name, user=None):
        tx = TRANSFORMS[name](user)
        pipe = pipeline.distribute(mlp.model, config._replace(replica_mean=tx), mesh)
        args = (mlp.params, batch, pipe.init(mlp.params, batch), jax.random.key(0))
        return tx, pipe, jax.jit(pipe.step).lower(*args).compile()

    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, LINK))
    return types.SimpleNamespace(
        sim=sim,
        sim_step=jax.jit(sim.step),
        distributed=distributed,
    )


def _by_hand(tx, mlp, batch, keys, sim, step):
    """Per replica, the simulated pipeline's gradients on its half batch (key fold_in(key, r));
    then per stage the transform's update in a shard_map over a 2-device data mesh. Per key:
    ``(updates, bytes sent, the replicas' plain mean)``."""
    half = batch["x"].shape[0] // 2
    parts = [{k: v[r * half : (r + 1) * half] for k, v in batch.items()} for r in range(2)]
    link_states = [sim.init(mlp.params, p) for p in parts]
    mesh = comm.make_mesh([(comm.DATA, 2)], jax.devices()[:2])
    states = [comm.place_state(tx.init(p), mesh, comm.DATA) for p in mlp.params]
    specs = comm.state_specs(tx.init(mlp.params[0]), comm.DATA)
    # the stages are alike (one width): one program for every stage's update (one per stage
    # compiled the same program four times)
    assert all(comm.state_specs(tx.init(p), comm.DATA) == specs for p in mlp.params)
    update = jax.jit(jax.shard_map(
        lambda st, g: tx.update(jax.tree.map(lambda x: x[0], g), st),
        mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=(P(), specs),
    ))  # fmt: skip
    out = []
    for key in keys:
        grads = []
        for r in range(2):
            _, g, link_states[r], _ = step(
                mlp.params, parts[r], link_states[r], jax.random.fold_in(key, r)
            )
            grads.append(g)
        averaged, mean = [], []
        for s in range(len(mlp.params)):
            g = jax.tree.map(lambda a, b: jnp.stack([a, b]), grads[0][s], grads[1][s])
            u, states[s] = update(states[s], jax.device_put(g, NamedSharding(mesh, P("data"))))
            averaged.append(u)
            mean.append(jax.tree.map(lambda x: np.asarray(x).mean(0), g))
        sent = sum(float(st.bytes_sent) for st in _bytes_states(states))
        out.append((averaged, sent, mean))
    return out


def _bytes_states(states):
    found = []
    for st in states:
        jax.tree.map(
            lambda x: found.append(x) or x, st,
            is_leaf=lambda x: hasattr(x, "_fields") and "bytes_sent" in x._fields,
        )  # fmt: skip
    return [x for x in found if hasattr(x, "_fields")]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_replica_averaging_equals_the_transform_applied_by_hand(
    name, setup, programs, tools, load_test_module
):
    mlp, batch, mesh = setup
    user = load_test_module("transforms/test_user_protocol.py") if name.startswith("user") else None
    tx, pipe, step = programs.distributed(name, user)
    states = pipe.init(mlp.params, batch)
    keys = [jax.random.key(i) for i in range(STEPS)]
    expected = _by_hand(tx, mlp, batch, keys, programs.sim, programs.sim_step)
    for key, (want, sent, mean) in zip(keys, expected):
        loss, grads, states, metrics = step(mlp.params, batch, states, key)
        got, want = ([np.asarray(x) for x in jax.tree.leaves(tree)] for tree in (grads, want))
        tools.close(got, want, rtol=1e-5, atol=1e-6)
        assert float(metrics["data_wire_bytes"]) == sent < float(metrics["data_dense_bytes"])
        # the averaged gradients differ from the replicas' plain mean (the transform did run;
        # a plain mean's bytes: test_plain_mean_of_a_heterogeneous_cnn_sends_each_stage_unpadded)
        differs = [
            not np.allclose(a, b, rtol=1e-3, atol=1e-5)
            for a, b in zip(got, jax.tree.leaves(mean), strict=True)
        ]
        assert any(differs)


def test_data_axis_bytes_in_the_program_are_the_reported_bytes(setup, programs):
    """The HLO's gradient collectives over ``data`` (one per stage, each run by its stage's
    devices) carry the transform's payloads: PowerSGD's factors, no dense gradient."""
    mlp, batch, mesh = setup
    _, pipe, compiled = programs.distributed("power_sgd_ef", None)  # the cache key of the slow test
    states = pipe.init(mlp.params, batch)
    report = comm.collective_report(compiled.as_text())
    data = [r for r in report.records if r.group_size == 2 and r.kind != "collective-permute"]
    # the loss and metric means over data are scalars: every other record is a gradient payload
    scalars = re.compile(r"\(?f32\[\](, f32\[\])*\)?")
    tensor_bytes = sum(r.total_bytes for r in data if not scalars.fullmatch(r.shape))
    _, _, _, metrics = compiled(mlp.params, batch, states, jax.random.key(0))
    assert tensor_bytes == float(metrics["data_wire_bytes"])
    assert tensor_bytes < float(metrics["data_dense_bytes"]) / 3


def test_replica_averaging_errors(setup):
    mlp, batch, mesh = setup
    with pytest.raises(TypeError, match="replica_mean must be None or an optax"):
        pipeline.distribute(
            mlp.model, pipeline.PipelineConfig(mlp.M, replica_mean="powersgd"), mesh
        )
    tx = _power_sgd_ef()
    with_tx = pipeline.distribute(mlp.model, pipeline.PipelineConfig(mlp.M, replica_mean=tx), mesh)
    without = pipeline.distribute(mlp.model, pipeline.PipelineConfig(mlp.M), mesh)
    with pytest.raises(ValueError, match="have no replica-averaging state"):
        with_tx.step(mlp.params, batch, without.init(mlp.params, batch))


@pytest.mark.slow
def test_plain_mean_of_a_heterogeneous_cnn_sends_each_stage_unpadded(tools, cnn):
    """Without a transform the replicas' float mean sends each stage's own parameter bytes (not
    the largest stage's packed row) and gives the unpipelined gradient of the whole batch."""
    # the 3-stage CNN: stages of 40, 304 and 90 floats
    batch = {k: jnp.concatenate([v, v[::-1]]) for k, v in cnn.batch.items()}
    mesh = pipeline.pipeline_mesh(3, jax.devices()[:6])  # 2 replicas
    pipe = pipeline.distribute(cnn.model, pipeline.PipelineConfig(cnn.M, schedule="1f1b"), mesh)
    args = (cnn.params, batch, pipe.init(cnn.params, batch), None)
    compiled = jax.jit(pipe.step).lower(*args).compile()
    loss, grads, _, metrics = compiled(*args)
    ref_loss, ref_grads = tools.reference(cnn.model, cnn.params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(list(grads), ref_grads)
    report = comm.collective_report(compiled.as_text())
    scalars = re.compile(r"\(?f32\[\](, f32\[\])*\)?")
    data = [r for r in report.records if r.group_size == 2 and r.kind != "collective-permute"]
    tensor_bytes = sum(r.total_bytes for r in data if not scalars.fullmatch(r.shape))
    stage_bytes = [sum(x.size * 4 for x in jax.tree.leaves(p)) for p in cnn.params]
    assert tensor_bytes == float(metrics["data_wire_bytes"]) == sum(stage_bytes)
    assert float(metrics["data_dense_bytes"]) == sum(stage_bytes) < 3 * max(stage_bytes)
