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
# # Flax NNX models: compressed data parallelism and a compressed pipeline
#
# The same digits task twice, with models written in Flax NNX. First an `nnx.Module` MLP
# trained data-parallel on 8 (fake CPU) workers, its gradients averaged by Accordion (PowerSGD
# rank 2 / 1 with error feedback): `parallel.data_parallel` takes the module itself, splits it
# into its parameters and the rest, keeps every worker's gradient local (no hidden dense
# all-reduce) and merges the trained weights back. Then the MLP cut into 4 NNX stage modules on
# a pipeline with 4-bit activations and 8-bit gradients at the boundaries, its optimizer given
# the stage parameters by name (`pipeline.unpacked`): weight decay on the kernels only.

# %%
# %matplotlib inline
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from IPython.display import display
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import data
from jaxcomp import parallel
from jaxcomp import pipeline
from jaxcomp import transforms

SMOKE = os.environ.get("JAXCOMP_NOTEBOOK_SMOKE") == "1"
STEPS = 12 if SMOKE else 300
train, test = data.digits("train"), data.digits("test")
loader = data.Loader(train, 128, seed=0)
test_x, test_y = test.__getitems__(np.arange(len(test))).values()
print(f"{STEPS} steps of batch 128, {len(train)} train / {len(test)} test digits")


# %% [markdown]
# ## Data parallelism from an `nnx.Module`
#
# The loss takes the module. `dp.init(model)` holds its `nnx.Param` variables as nested dicts
# (`state.params["fc1"]["kernel"]`, the names a Linen model's parameters have) and the rest of
# the module (its graph) beside them; `state.module()` merges them back.


# %%
class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(64, 256, rngs=rngs)
        self.fc2 = nnx.Linear(256, 256, rngs=rngs)
        self.head = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def loss_fn(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


model = MLP(nnx.Rngs(0))
tx = optax.chain(
    transforms.accordion(compressors.power_sgd(2), compressors.power_sgd(1), interval_steps=11),
    optax.sgd(0.05, momentum=0.9),
)
dp = parallel.data_parallel(loss_fn, tx, comm.make_mesh([("data", 8)]))
state, position, losses = dp.init(model), loader.initial_state(), []
for _ in range(STEPS):
    batch, position = loader.next(position)
    state, metrics = dp.step(state, (batch["x"], batch["label"]))
    losses.append(float(metrics["loss"]))
nnx.update(model, nnx.state(state.module()))  # the trained weights, back in our module
accuracy = float((model(test_x).argmax(-1) == test_y).mean())
sent, dense = float(metrics["bytes_sent"][0]), float(metrics["dense_bytes"][0])  # per worker
print(f"test accuracy {accuracy:.4f}; {sent:.0f} bytes per step per worker, dense {dense:.0f}")
modes = jax.tree.map(int, transforms.accordion_metrics(state.opt_state)["modes"])
print("per-layer modes (0 low compression, 1 high, -1 sent uncompressed):", modes)
assert accuracy > (0.5 if SMOKE else 0.9)

# %% [markdown]
# ## A compressed pipeline of NNX stages
#
# One module per stage (`pipeline.nnx_stages`), 4-bit activations forward and 8-bit
# activation-gradients backward at each boundary, and an optimizer that sees each stage's
# parameters by name: `optax.masked` weight decay on the kernels only, as it would be on the
# unpipelined model (on the packed `{dtype: [S, L]}` buffers a mask by name finds no names).


# %%
class Stage(nnx.Module):
    def __init__(self, features_in, features, rngs, relu=True):
        self.fc = nnx.Linear(features_in, features, rngs=rngs)
        self.relu = relu

    def __call__(self, x):
        y = self.fc(x)
        return nnx.relu(y) if self.relu else y


widths = [64, 256, 256, 256]
modules = [Stage(a, b, nnx.Rngs(i)) for i, (a, b) in enumerate(zip(widths, widths[1:]))]
modules.append(Stage(256, 10, nnx.Rngs(3), relu=False))


def stage_loss(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


stages = pipeline.nnx_stages(modules, stage_loss)
mesh = pipeline.pipeline_mesh(4)  # 2 replicas x 4 stages
link = pipeline.link(compressors.quantize(4, scale="feature"), compressors.quantize(8))
pipe = pipeline.distribute(stages.model, pipeline.PipelineConfig(4, link), mesh)
params = pipeline.pack_params(stages.params, NamedSharding(mesh, P("stage")))
kernels = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", p)
opt = pipeline.unpacked(
    optax.chain(optax.masked(optax.add_decayed_weights(1e-4), kernels), optax.adam(1e-3)), mesh
)


@jax.jit
def train_step(params, opt_state, states, batch, key):
    loss, grads, states, metrics = pipe.step(params, batch, states, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, states, loss, metrics


batch, _ = loader.next(loader.initial_state())
states, opt_state = pipe.init(params, batch), opt.init(params)
position, pipe_losses = loader.initial_state(), []
for t in range(STEPS):
    batch, position = loader.next(position)
    params, opt_state, states, loss, metrics = train_step(
        params, opt_state, states, batch, jax.random.key(t)
    )
    pipe_losses.append(float(loss))
trained = stages.modules(params)  # merged back: one module per stage
h = test_x
for module in trained:
    h = module(h)
pipe_accuracy = float((h.argmax(-1) == test_y).mean())
wire, dense = int(metrics["wire_bytes"]), int(metrics["dense_bytes"])
print(f"pipeline test accuracy {pipe_accuracy:.4f}; boundary bytes per step {wire} (dense {dense})")
assert pipe_accuracy > (0.5 if SMOKE else 0.9)

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses, label="data parallel, Accordion (PowerSGD + EF)")
ax.plot(pipe_losses, label="pipeline, 4-bit / 8-bit boundaries")
ax.set(xlabel="step", ylabel="training loss", yscale="log", title="NNX models on digits")
ax.legend()
display(fig)
plt.close(fig)
