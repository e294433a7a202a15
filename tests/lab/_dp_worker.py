"""One host of the dense vs PowerSGD lab test (run by test_dp_speed.py in the lab).

    python _dp_worker.py OUT.json

Joins the lab's hosts (one CPU device each; the lab's JAX_* variables), builds the
data-parallel step of the digits MLP's shapes (64-256-256-256-10: 589 KiB of float32
gradient) twice through ``parallel.data_parallel``: averaged densely
(``compressed_mean(identity)``) and by PowerSGD rank 2 with error feedback; runs both
alternately and host 0 writes each one's step times and the bytes its compiled step moves.
"""

import json
import os
import statistics
import sys
import time

WARMUP, STEPS = 1, 4
SIZES = (64, 256, 256, 256, 10)


def main(out: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp import comm
    from jaxcomp import compressors
    from jaxcomp import feedback
    from jaxcomp import parallel
    from jaxcomp import transforms

    mesh = comm.make_mesh([("data", jax.device_count())])
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a)
              for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))}  # fmt: skip
    params |= {f"b{i}": np.zeros(b, np.float32) for i, b in enumerate(SIZES[1:])}
    batch = {"x": rng.standard_normal((32 * jax.device_count(), 64)).astype(np.float32),
             "y": rng.integers(0, 10, 32 * jax.device_count()).astype(np.int32)}  # fmt: skip
    split = NamedSharding(mesh, P("data"))
    batch = {k: jax.make_array_from_callback(v.shape, split, lambda i, v=v: v[i])
             for k, v in batch.items()}  # fmt: skip

    def loss_fn(p, b):
        h = b["x"]
        for i in range(len(SIZES) - 1):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            h = jax.nn.relu(h) if i < len(SIZES) - 2 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, b["y"]).mean()

    channels = {
        "dense": feedback.plain(compressors.identity()),
        "powersgd": feedback.error_feedback(compressors.power_sgd(2)),
    }
    steps, states, results = {}, {}, {}
    for name, channel in channels.items():
        tx = optax.chain(transforms.compressed_mean(channel, "data"), optax.sgd(0.05))
        dp = parallel.data_parallel(loss_fn, tx, mesh)
        states[name] = dp.init(jax.tree.map(jnp.asarray, params))
        steps[name] = dp.step
        report = comm.measure_collectives(dp.step, states[name], batch)
        results[name] = {"bytes": report.total_bytes, "times": []}
        for _ in range(WARMUP):
            states[name], m = dp.step(states[name], batch)
            jax.block_until_ready(m)
    for _ in range(STEPS):
        for name in channels:
            t0 = time.perf_counter()
            states[name], m = steps[name](states[name], batch)
            jax.block_until_ready(m)
            results[name]["times"].append(time.perf_counter() - t0)
    for r in results.values():
        r["median_s"] = statistics.median(r["times"])
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
