"""The calibration probe: JAX collectives across the lab's hosts, timed (run on every host).

``python -m jaxcomp.lab._probe OUT.json --sizes 1024,4096,... --reps 7`` joins the hosts with
``jax.distributed`` (gloo CPU collectives; the coordinator, process count and id from the
lab's ``JAX_*`` environment variables) and
times, for each size ``n`` (bytes of float32 per device, as the HLO meter counts a collective's
operand):

* ``all-reduce``: ``psum`` over every device of every host (one flat group of ``W``, as the
  trainer's gradient mean runs);
* ``collective-permute`` (the ping-pong): device 0 (host 0) sends ``n`` bytes to the first
  device of host 1, which sends them back; half the round trip is one message.

Each program is compiled and run twice before ``reps`` timed calls; host 0 writes the median
and every time. All hosts run the same sizes in the same order (SPMD: each collective needs
every process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

#: dependent permutes per timed call of the chain probe
CHAIN_PERMUTES = 4


def _timed(fn, x, reps: int) -> list[float]:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(x))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.lab._probe")
    p.add_argument("out")
    p.add_argument("--sizes", required=True, help="bytes per device, comma-separated")
    p.add_argument("--pingpong_sizes", default="", help="bytes per message, comma-separated")
    p.add_argument("--chain_sizes", default="", help="bytes per message, comma-separated")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
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

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    local = jax.local_device_count()
    sharding = NamedSharding(mesh, P("d"))

    def array(nbytes):
        rows = np.ones((local, max(nbytes // 4, 1)), np.float32)
        return jax.make_array_from_process_local_data(sharding, rows)

    def spmd(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    results = {"devices": len(devices), "hosts": jax.process_count(), "local_devices": local,
               "all-reduce": [], "collective-permute": []}  # fmt: skip
    allreduce = spmd(lambda x: lax.psum(x, "d"))
    for n in [int(s) for s in args.sizes.split(",") if s]:
        ts = _timed(allreduce, array(n), args.reps)
        results["all-reduce"].append({"bytes": n, "median_s": statistics.median(ts), "times": ts})
    other = local if jax.process_count() > 1 else min(1, len(devices) - 1)
    if other:

        def pingpong(x):
            there = lax.ppermute(x, "d", perm=[(0, other)])
            return lax.ppermute(there, "d", perm=[(other, 0)])

        roundtrip = spmd(pingpong)
        for n in [int(s) for s in args.pingpong_sizes.split(",") if s]:
            ts = [t / 2 for t in _timed(roundtrip, array(n), args.reps)]
            results["collective-permute"].append(
                {"bytes": n, "median_s": statistics.median(ts), "times": ts}
            )
    chain_sizes = [int(s) for s in args.chain_sizes.split(",") if s]
    if chain_sizes and jax.process_count() >= 3:
        results["chain"] = []
        first = [(0, local)]
        chained = [(0, local), (local, 2 * local)]  # host 1 receives and sends

        def repeated(pairs):
            def body(x):
                for _ in range(CHAIN_PERMUTES):
                    x = lax.ppermute(x, "d", perm=pairs) + 1.0
                return x

            return spmd(body)

        one, chain = repeated(first), repeated(chained)
        for n in chain_sizes:
            x = array(n)
            t1 = [t / CHAIN_PERMUTES for t in _timed(one, x, args.reps)]
            t2 = [t / CHAIN_PERMUTES for t in _timed(chain, x, args.reps)]
            results["chain"].append({"bytes": n, "one_s": statistics.median(t1),
                                     "chain_s": statistics.median(t2), "one_times": t1,
                                     "chain_times": t2})  # fmt: skip
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
