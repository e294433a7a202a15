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
# # A small compressed pipeline
#
# The digits MLP cut into 4 stages runs as a GPipe pipeline over the `stage` axis of 4 (fake
# CPU) devices. Every boundary sends 4-bit activations forward and 8-bit activation-gradients
# backward. We train it with the library's trainer, read the bytes on the wire from the
# compiled HLO, and compare evaluation with boundary compression on and off.

# %%
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import tempfile

import ml_collections

from jaxcomp import models
from jaxcomp import train

SMOKE = os.environ.get("JAXCOMP_NOTEBOOK_SMOKE") == "1"  # the tests run the small sizes

# %% [markdown]
# ## The staged model and its cut points

# %%
model = models.mlp(hidden=(128, 128, 128))
print("segments:", model.segment_names, "cut after:", model.cuts)
print("boundary activations per microbatch of 16:", [s.shape for s in model.boundary_shapes(16)])

# %% [markdown]
# ## Train with compressed boundaries

# %%
config = ml_collections.ConfigDict()
config.mode = "pipeline"
config.mesh = [("stage", 4)]
config.model_name = "mlp"
config.model = dict(hidden=(128, 128, 128))
config.data_name = "digits"
config.batch_size = 64
config.eval_batch_size = 64
config.optax_name = "adam"
config.lr = 2e-3
config.total_steps = 12 if SMOKE else 600
config.log_every = 10
config.pipeline = dict(
    num_microbatches=4,
    forward=dict(name="quantize", bits=4, scale="feature"),
    backward=dict(name="quantize", bits=8),
)
workdir = tempfile.mkdtemp()
summary = train.train_and_evaluate(config, workdir)

# %%
print(
    f"boundary bytes per step: {summary['boundary_bytes_per_step']:.0f} "
    f"(dense {summary['boundary_dense_bytes_per_step']:.0f}, "
    f"{summary['compression_ratio']:.1f}x smaller)"
)
print(
    f"accuracy: compression on {summary['final_accuracy']:.3f}, "
    f"off {summary['final_accuracy_uncompressed']:.3f}"
)
assert summary["compression_ratio"] > 4
assert summary["final_accuracy"] > 0.5

# %% [markdown]
# ## The same pipeline, simulated on one device
#
# `pipeline.simulate` applies the same links at the cut points on a single device; with the
# same keys it gives the same numbers as the distributed pipeline. It is the quick way to
# sweep codecs.

# %%
config.pipeline = dict(config.pipeline.to_dict(), simulate=True)
sim = train.train_and_evaluate(config, tempfile.mkdtemp())
print(
    f"simulated: accuracy on {sim['final_accuracy']:.3f}, off "
    f"{sim['final_accuracy_uncompressed']:.3f}; distributed: {summary['final_accuracy']:.3f}"
)
assert abs(sim["final_accuracy"] - summary["final_accuracy"]) < 0.05

# %% [markdown]
# The curves the trainer wrote:

# %%
from IPython.display import Image  # noqa: E402

Image(filename=os.path.join(workdir, "metrics.png"))
