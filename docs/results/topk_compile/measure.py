"""Compile time (CPU seconds) and call time of exact and blockwise TopK against lax.top_k.

  tools/cpu-slot env JAX_PLATFORMS=cpu python docs/results/topk_compile/measure.py

One process, one device; each program compiled once (``lower().compile()``), then called 20
times after one warm-up call. Results: README.md beside it.
"""

import time

import jax
import jax.numpy as jnp

from jaxcomp import compressors


def measure(name, codec, x):
    f = jax.jit(lambda x: codec.compress(x, codec.init(x), None)[0])
    c0, w0 = time.process_time(), time.perf_counter()
    compiled = f.lower(x).compile()
    c1, w1 = time.process_time(), time.perf_counter()
    jax.block_until_ready(compiled(x))
    t0 = time.perf_counter()
    for _ in range(20):
        jax.block_until_ready(compiled(x))
    run = (time.perf_counter() - t0) / 20
    print(f"{name:32s} {str(x.shape):12s} compile {c1 - c0:5.2f} s CPU ({w1 - w0:5.2f} s wall), "
          f"call {run * 1e3:7.3f} ms")  # fmt: skip


for shape in [(64, 256), (128, 256), (1024, 1024)]:
    x = jax.random.normal(jax.random.key(0), shape)
    measure("top_k(0.1) exact", compressors.top_k(0.1), x)
    measure("top_k(0.1, method='blockwise')", compressors.top_k(0.1, method="blockwise"), x)
    k = max(1, int(0.1 * x.size))
    f = jax.jit(lambda x, k=k: jax.lax.top_k(jnp.abs(x).ravel(), k))
    c0 = time.process_time()
    compiled = f.lower(x).compile()
    c1 = time.process_time()
    jax.block_until_ready(compiled(x))
    t0 = time.perf_counter()
    for _ in range(20):
        jax.block_until_ready(compiled(x))
    run = (time.perf_counter() - t0) / 20
    print(f"{'lax.top_k (reference)':32s} {str(x.shape):12s} compile {c1 - c0:5.2f} s CPU, "
          f"call {run * 1e3:7.3f} ms")  # fmt: skip
