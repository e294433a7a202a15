"""Sends of 32 KiB at once on per-host links (docs/results/network/pipeline_model.md): one pair,
two disjoint pairs, and chains in which a middle host sends and receives in the same permute.

Run once per host by the lab (4 hosts x 1 device; the repository on ``PYTHONPATH``)::

  python -m jaxcomp.lab run --hosts 4 --devices 1 --rate 10mbit --log_dir DIR -- \\
    python docs/results/network/duplex_probe.py OUT.json [BYTES,...]

Each pattern and size: 6 dependent permutes per call, 2 warm-up calls, 7 timed; host 0 writes
the median and the minimum per permute, in ms (one size: ``{pattern: ...}``; several:
``{bytes: {pattern: ...}}``).
"""

import json
import os
import statistics
import sys

from jaxcomp.lab import _probe

PATTERNS = {
    "one": [(0, 1)],
    "disjoint": [(0, 1), (2, 3)],
    "chain2": [(0, 1), (1, 2)],
    "chain3": [(0, 1), (1, 2), (2, 3)],
    "back3": [(1, 0), (2, 1), (3, 2)],
    "swap": [(0, 1), (1, 0)],
}
PERMUTES, REPS = 6, 7


def main(out_path: str, sizes: list[int]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    out = {}
    for nbytes in sizes:
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("d")), np.ones((1, nbytes // 4), np.float32)
        )
        row = out.setdefault(str(nbytes), {})
        for name, pairs in PATTERNS.items():

            def body(v, pairs=pairs):
                for _ in range(PERMUTES):
                    v = lax.ppermute(v, "d", pairs) + 1.0
                return v

            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
            times = [t / PERMUTES for t in _probe._timed(f, x, REPS)]  # after 2 warm-up calls
            row[name] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    if len(sizes) == 1:
        out = out[str(sizes[0])]
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "32768").split(",")])
