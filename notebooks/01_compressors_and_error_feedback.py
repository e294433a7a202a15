# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Compressors and error feedback
#
# A codec in `jaxcomp.compressors` is three pure functions: `init`, `compress`, `decompress`.
# The payload is what would cross the wire, in the dtypes that travel. This notebook
# compresses a gradient-like vector with TopK and 4-bit quantization, counts the bytes, and
# shows why *error feedback* matters: plain TopK drops the same small coordinates every step,
# while error feedback remembers what it dropped and sends it later.

# %%
# %matplotlib inline
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

from jaxcomp import compressors
from jaxcomp import feedback

SMOKE = os.environ.get("JAXCOMP_NOTEBOOK_SMOKE") == "1"  # the tests run the small sizes
n = 4096
x = jax.random.normal(jax.random.key(0), (n,))

# %% [markdown]
# ## Bytes on the wire


# %%
def round_trip(codec, x, key):
    """The payload and the relative error of its decoding."""
    payload, _ = codec.compress(x, codec.init(x), key)
    x_hat = codec.decompress(payload, x)
    return payload, jnp.linalg.norm(x_hat - x) / jnp.linalg.norm(x)


rows = []
for codec in [
    compressors.identity(),
    compressors.cast("bfloat16"),
    compressors.quantize(4),
    compressors.top_k(0.1),
    compressors.top_k(0.01),
    compressors.sign(),
]:
    # one compiled program per codec (eagerly, each of its operations would compile alone)
    payload, err = jax.jit(functools.partial(round_trip, codec))(x, jax.random.key(1))
    rows.append((codec.name, compressors.wire_bytes(payload), float(err)))
print(f"{'codec':28s} {'bytes':>7s} {'ratio':>6s} {'rel. error':>10s}")
for name, b, err in rows:
    print(f"{name:28s} {b:7d} {4 * n / b:6.1f} {err:10.3f}")
assert rows[0][1] == 4 * n and rows[3][1] < 4 * n // 5

# %% [markdown]
# ## Error feedback: the dropped mass comes back
#
# Send the *same* vector `g` for `T` steps through TopK(10%). Without feedback the receiver
# sees the same 102 coordinates every time; with residual error feedback
# (`feedback.error_feedback`), the residual `e` grows on the unsent coordinates until they win a
# place, so the running average of what arrived converges to `g`. The telescoping identity
# `x + e_old == x_hat + e_new` holds at every step.

# %%
T = 100 if SMOKE else 1000
g = jax.random.normal(jax.random.key(2), (1024,))
codec = compressors.top_k(0.1)
plain = feedback.plain(codec)
ef = feedback.error_feedback(codec)


@jax.jit
def run(g):
    def body(carry, _):
        (s_plain, s_ef, sum_plain, sum_ef) = carry
        p1, s_plain = plain.send(g, s_plain)
        e_old = s_ef.residual
        p2, s_ef = ef.send(g, s_ef)
        got_plain, _ = plain.receive(p1, None, g)
        got_ef, _ = ef.receive(p2, None, g)
        telescoping = jnp.max(jnp.abs((g + e_old) - (got_ef + s_ef.residual)))
        sum_plain, sum_ef = sum_plain + got_plain, sum_ef + got_ef
        return (s_plain, s_ef, sum_plain, sum_ef), (sum_plain, sum_ef, telescoping)

    init = (plain.init(g)[0], ef.init(g)[0], jnp.zeros_like(g), jnp.zeros_like(g))
    _, (sp, se, tel) = jax.lax.scan(body, init, None, length=T)
    steps = jnp.arange(1, T + 1)[:, None]
    err = lambda s: jnp.linalg.norm(s / steps - g, axis=1) / jnp.linalg.norm(g)  # noqa: E731
    return err(sp), err(se), tel


err_plain, err_ef, telescoping = run(g)
print(
    f"after {T} steps: relative error of the average, plain {err_plain[-1]:.3f}, "
    f"error feedback {err_ef[-1]:.3f}; telescoping max deviation {telescoping.max():.2e}"
)
assert err_ef[-1] < 0.5 * err_plain[-1]
assert float(telescoping.max()) < 1e-4

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(np.asarray(err_plain), label="TopK 10%, no feedback")
ax.plot(np.asarray(err_ef), label="TopK 10% + error feedback")
ax.set_xlabel("step")
ax.set_ylabel("relative error of the mean received")
ax.set_yscale("log")
ax.legend()
display(fig)  # inline: the figure is in the saved notebook (tests run it under Agg)
plt.close(fig)
