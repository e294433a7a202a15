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
# # Accordion: per-layer compression that follows the gradient norm
#
# Eight data-parallel (fake CPU) workers train the digits MLP. Each layer's gradient is averaged
# with PowerSGD rank 2 (low compression) in a *critical regime* and rank 1 (high compression)
# otherwise. A regime is critical when the norm of the layer's gradient, accumulated over an
# interval (an epoch), changed by at least `eta` (relative) since the last check (Agarwal et al.,
# 2021). We log every layer's mode at every step, next to its gradient-norm statistic, and the
# bytes each layer puts on the wire in either mode.

# %%
# %matplotlib inline
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
from IPython.display import display

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import data
from jaxcomp import models
from jaxcomp import parallel
from jaxcomp import transforms

SMOKE = os.environ.get("JAXCOMP_NOTEBOOK_SMOKE") == "1"  # the tests run the small sizes

# %% [markdown]
# ## The model, the data and the transform

# %%
model = models.mlp(hidden=(256, 256, 256))
params = tuple(v["params"] for v in model.init(jax.random.key(0)))
loader = data.Loader(data.get_dataset("digits", "train"), 128, seed=0)
steps_per_epoch = loader.steps_per_epoch
low, high = compressors.power_sgd(2), compressors.power_sgd(1)
tx = optax.chain(
    transforms.accordion(low, high, interval_steps=steps_per_epoch, check_every=1, eta=0.5),
    optax.sgd(0.05, momentum=0.9),
)


def loss_fn(params, batch):
    logits, _ = model.apply(tuple({"params": p} for p in params), batch["x"], train=True)
    return model.loss_fn(logits, batch["label"])


mesh = comm.make_mesh([("data", 8)], jax.devices()[:8])
dp = parallel.data_parallel(loss_fn, tx, mesh)
state = dp.init(params)
names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
         for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]  # fmt: skip
print(len(names), "parameter leaves; interval =", steps_per_epoch, "steps")

# %% [markdown]
# ## Bytes per layer in each mode
#
# PowerSGD sends two factors per matrix, `(rows + cols) x rank` floats; vectors (biases) are
# sent dense by both modes (compressing them would not pay).

# %%
print(f"{'leaf':28s} {'shape':>12s} {'dense':>9s} {'rank 2':>9s} {'rank 1':>9s}")
for name, leaf in zip(names, jax.tree.leaves(params)):
    like = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    dense = compressors.wire_bytes(like)
    if leaf.ndim == 2:
        b_low = compressors.wire_bytes(compressors.payload_shape(low, like))
        b_high = compressors.wire_bytes(compressors.payload_shape(high, like))
    else:
        b_low = b_high = dense
    print(f"{name:28s} {str(leaf.shape):>12s} {dense:9d} {b_low:9d} {b_high:9d}")

# %% [markdown]
# ## Train and record the modes

# %%
epochs = 2 if SMOKE else 27
modes, sent, losses = [], [], []
for epoch in range(epochs):
    for batch in loader.epoch(epoch):
        state, metrics = dp.step(state, {"x": batch["x"], "label": batch["label"]})
        m = transforms.accordion_metrics(state.opt_state)
        modes.append([int(v) for v in jax.tree.leaves(m["modes"])])
        sent.append(float(m["bytes_sent"]))
        losses.append(float(metrics["loss"]))
modes = np.array(modes)
print(f"{len(losses)} steps, final loss {losses[-1]:.4f}")
print("mean bytes per step:", f"{np.mean(sent):,.0f}", "(dense:",
      f"{sum(compressors.wire_bytes(p) for p in jax.tree.leaves(params)):,})")  # fmt: skip

# %%
matrices = [i for i, leaf in enumerate(jax.tree.leaves(params)) if leaf.ndim == 2]
fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
for j, i in enumerate(matrices):
    ax0.step(range(len(modes)), modes[:, i] + 0.04 * j, where="post", label=names[i])
ax0.set_yticks([transforms.LOW_COMPRESSION, transforms.HIGH_COMPRESSION])
ax0.set_yticklabels(["low (rank 2)", "high (rank 1)"])
ax0.legend(fontsize=7)
ax0.set_title("per-layer mode")
ax1.plot(sent)
ax1.set_ylabel("bytes sent")
ax2.plot(losses)
ax2.set_yscale("log")
ax2.set_ylabel("train loss")
ax2.set_xlabel("step")
for e in range(1, epochs):
    for ax in (ax0, ax1, ax2):
        ax.axvline(e * steps_per_epoch, color="grey", alpha=0.2)
fig.tight_layout()
display(fig)  # inline: the figure is in the saved notebook (tests run it under Agg)
plt.close(fig)

# %% [markdown]
# Early, while the gradient norms change fast, every layer is critical and sends rank 2; once
# the relative change of an interval's norm falls below `eta` the layer drops to rank 1. With
# `check_every=1` a layer can return to rank 2 after any interval whose norm moved again. The
# committed studies (`docs/results/accordion_*`) compare this with static rank 1 and rank 2.
