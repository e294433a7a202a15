"""One process of the two-process hierarchical-mean test (run by test_compressed_mean_pair.py).

    python _pair_worker.py PROCESS_ID PORT OUT.npz

Two processes x 2 CPU devices form a (slow=2, fast=2) mesh whose slow axis is the process
boundary (gloo): compressed_mean(error_feedback(power_sgd(2)), ("slow", "fast")) averages
dense inside each process and compressed across them. Process 0 writes two steps' means.
:func:`run` is shared with the test's single-process reference.
"""

import sys

import numpy as np

STEPS = 2


def run(mesh):
    """Two steps of the hierarchical mean on ``mesh`` (slow x fast = 2 x 2); the means."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp import comm
    from jaxcomp import compressors as C
    from jaxcomp import feedback as F
    from jaxcomp import transforms as T

    rng = np.random.default_rng(0)
    grads = {"w": rng.standard_normal((4, 16, 8)).astype(np.float32),
             "b": rng.standard_normal((4, 8)).astype(np.float32)}  # fmt: skip
    tx = T.compressed_mean(F.error_feedback(C.power_sgd(2)), ("slow", "fast"))
    with jax.set_mesh(mesh):
        state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], grads)), mesh, "slow")
    specs = comm.state_specs(state, "slow")
    both = NamedSharding(mesh, P(("slow", "fast")))
    g = jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, both, lambda idx, x=x: x[idx]), grads
    )
    step = jax.jit(
        jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
                      in_specs=(P(("slow", "fast")), specs), out_specs=(P(), specs))
    )  # fmt: skip
    out = {}
    for i in range(STEPS):
        mean, state = step(g, state)
        for k, v in mean.items():
            out[f"{k}_{i}"] = np.asarray(v.addressable_data(0))
        out[f"bytes_sent_{i}"] = np.asarray(state.bytes_sent.addressable_data(0))
    return out


def main(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jaxcomp import comm

    mesh = comm.make_mesh([("slow", 2), ("fast", 2)])  # devices ordered process by process
    assert [d.process_index for d in mesh.devices[:, 0]] == [0, 1]
    result = run(mesh)
    if process_id == 0:
        np.savez(out, **result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
