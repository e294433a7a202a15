"""Sends of 32 KiB at once on per-host links: one pair, two disjoint pairs, chains of 2 and 3
(a middle host sends and receives in the same permute), R permutes per call, median per permute."""
import json, os, statistics, sys, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                           num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("d",))
sh = NamedSharding(mesh, P("d"))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
x = jax.make_array_from_process_local_data(sh, np.ones((1, n // 4), np.float32))
R, REPS = 6, 7
patterns = {"one": [(0, 1)], "disjoint": [(0, 1), (2, 3)], "chain2": [(0, 1), (1, 2)],
            "chain3": [(0, 1), (1, 2), (2, 3)], "back3": [(1, 0), (2, 1), (3, 2)]}
out = {}
for name, pairs in patterns.items():
    def body(v, pairs=pairs):
        for _ in range(R):
            v = lax.ppermute(v, "d", pairs) + 1.0
        return v
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    for _ in range(2):
        jax.block_until_ready(f(x))
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter(); jax.block_until_ready(f(x)); ts.append((time.perf_counter() - t0) / R)
    out[name] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts)}
if jax.process_index() == 0:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(out))
