"""One process of the two-process pipeline test (run by test_two_process.py).

    python _two_process_worker.py PROCESS_ID PORT OUT.npz

Two processes x 2 CPU devices form a 4-stage mesh; stages 1 -> 2 cross the process boundary
over gloo. Process 0 writes the loss, gradients and link states of two steps to OUT.npz.
:func:`build` is shared with the test's single-process reference.
"""

import sys

import numpy as np

STEPS = 2


def build():
    """The model, params, batch and pipeline config (deterministic, numpy-generated)."""
    import jax.numpy as jnp

    from jaxcomp import compressors as C
    from jaxcomp import feedback as F
    from jaxcomp import pipeline

    rng = np.random.default_rng(0)
    width, stages, m, mb = 8, 4, 4, 2
    params = [
        {"w": jnp.asarray(rng.normal(size=(width, width)) / 3, jnp.float32),
         "b": jnp.asarray(rng.normal(size=(width,)) / 10, jnp.float32)}
        for _ in range(stages)
    ]  # fmt: skip
    batch = {
        "x": jnp.asarray(rng.normal(size=(m * mb, width)), jnp.float32),
        "label": jnp.asarray(rng.normal(size=(m * mb, width)), jnp.float32),
        "ids": jnp.arange(m * mb, dtype=jnp.int32),
    }

    def stage(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def loss_fn(y, labels):
        return jnp.mean((y - labels) ** 2)

    link = pipeline.link(
        F.error_feedback(C.top_k(0.25, per_sample=True)), C.quantize(4, rounding="stochastic")
    )
    model = pipeline.StagedModel((stage,) * stages, loss_fn)
    return model, params, batch, pipeline.PipelineConfig(m, link)


def run(mesh):
    """Two steps on ``mesh``; returns host numpy arrays {name: value}."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp import pipeline

    model, params, batch, config = build()
    pipe = pipeline.distribute(model, config, mesh)
    packed = pipeline.pack_params(params, NamedSharding(mesh, P("stage")))
    batch = jax.device_put(batch, NamedSharding(mesh, P()))
    states = pipe.init(packed, batch)
    step = jax.jit(pipe.step)
    out = {}
    for i in range(STEPS):
        loss, grads, states, _ = step(packed, batch, states, jax.random.key(i))
        gathered = multihost_utils.process_allgather(
            {"loss": loss, "grads": grads.buffers, "states": states}, tiled=True
        )
        for j, leaf in enumerate(jax.tree.leaves(gathered)):
            out[f"step{i}_{j}"] = np.asarray(leaf)
    return out


def main(process_id, port, path):
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_disable_most_optimizations", True)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jaxcomp import pipeline

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    out = run(pipeline.pipeline_mesh(4))
    if process_id == 0:
        np.savez(path, **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
