"""One-process A/B of quantize(4)'s shrink factor (session 15): the codec as built and the same
codec with ``_quantize._shrink`` patched to 1 (no shrink), timed alternately, 60 rounds."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import compressors
from jaxcomp.compressors import _quantize as Q

x = jax.random.normal(jax.random.key(0), (1024, 4096), jnp.float32)


def make(scale, **kw):
    c = compressors.quantize(4, scale=scale, **kw)
    return jax.jit(lambda x: c.compress(x, c.init(x), None)[0])


fns = {}
for name, kw in [("feature", dict(scale="feature", axes=(0,))), ("tensor", dict(scale="tensor"))]:
    fns[name + "_new"] = make(**kw)
    real = Q._shrink
    Q._shrink = lambda s: jnp.ones((), jnp.float32)
    f = make(**kw)
    jax.block_until_ready(f(x))  # traced while the patch is on
    fns[name + "_old"] = f
    Q._shrink = real
for f in fns.values():
    jax.block_until_ready(f(x))
ts = {k: [] for k in fns}
for _ in range(60):
    for k, f in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts[k].append(time.perf_counter() - t)
for k, v in ts.items():
    lo, hi = 1e3 * np.percentile(v, 25), 1e3 * np.percentile(v, 75)
    print(f"{k:12s} {1e3 * np.median(v):6.2f} ms  IQR {lo:.2f}-{hi:.2f}")


def fusions(f):
    return f.lower(x).compile().as_text().count("fusion(")


print("new fusions", fusions(fns["feature_new"]), "old", fusions(fns["feature_old"]))
