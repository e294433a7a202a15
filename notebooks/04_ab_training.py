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
# # AB-Training: phases, ranks and bytes per step kind
#
# Eight (fake CPU) workers in 2 groups of 4 train the digits MLP (Coquelin et al., 2024): a
# full-rank data-parallel warm-up; then every hidden layer is factorised `W = A B` (SVD,
# singular values below a relative cutoff dropped) and the two groups train different factors
# independently, each averaging only inside its group; every `sync_every` steps the groups
# exchange and re-factorise, followed by a few full-rank "rebound" steps. We run the library's
# trainer and read, from what it writes, the phase and mean rank over time, the parameter
# compression ratio, and the bytes each kind of step sends.

# %%
# %matplotlib inline
import importlib.util
import json
import os
import pathlib
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import matplotlib.pyplot as plt
from IPython.display import display

import jaxcomp
from jaxcomp import train

SMOKE = os.environ.get("JAXCOMP_NOTEBOOK_SMOKE") == "1"  # the tests run the small sizes
ROOT = pathlib.Path(jaxcomp.__file__).parents[1]

# %% [markdown]
# ## The config
#
# `configs/digits_ab.py`, shortened at smoke size (the tests) so that every phase still occurs.

# %%
spec = importlib.util.spec_from_file_location("digits_ab", ROOT / "configs" / "digits_ab.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config(None)
if SMOKE:  # warm-up 0-1, AB 2-3 (a sync after 3), full rank 4 (re-factorised), AB 5
    config.total_steps, config.log_every, config.eval_every, config.checkpoint_every = 6, 1, 6, 0
    config.ab.warmup_steps, config.ab.sync_every, config.ab.full_rank_steps = 2, 4, 1
else:
    config.log_every = 1
print(dict(config.ab))

# %% [markdown]
# ## Train

# %%
workdir = tempfile.mkdtemp()
summary = train.train_and_evaluate(config, workdir)
with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
steps = [r for r in records if r.get("split") == "train"]

# %% [markdown]
# ## Bytes per step kind
#
# Read from each compiled program's HLO: a full-rank step all-reduces every gradient over all
# workers; an AB step all-reduces only the trained factors inside a group; a sync exchanges the
# factors between groups.

# %%
dense = summary["dense_bytes_per_step"]
for key in sorted(k for k in summary if k.startswith("hlo_bytes_")):
    kind = key.removeprefix("hlo_bytes_")
    print(
        f"{kind:12s} {summary[key] / 1024:9.1f} KiB per step  ({summary[key] / dense:.2f} x dense)"
    )
print(f"mean over the run: {summary['wire_bytes_per_step'] / 1024:.1f} KiB per step, "
      f"final accuracy {summary['final_accuracy']:.3f}")  # fmt: skip

# %% [markdown]
# The same mean step per collective kind and group size (`summary["collectives"]`: each step
# kind's program weighted by how many steps the schedule gives it, an AB step's two roles by
# their share of the workers), what the study report's cost model prices:

# %%
by_kind = {}
for r in summary["collectives"]:
    key = f"{r['kind']} over {r['group_size']} devices"
    by_kind[key] = by_kind.get(key, 0.0) + r["bytes_per_execution"] * r["executions"]
for key, nbytes in sorted(by_kind.items()):
    print(f"{key:36s} {nbytes / 1024:9.1f} KiB per step")
print(f"{'sum':36s} {sum(by_kind.values()) / 1024:9.1f} KiB per step")

# %% [markdown]
# ## Phase, rank and compression ratio over time

# %%
keys = [
    ("phase", "phase"),
    ("mean_rank", "mean rank (factored layers)"),
    ("compression_ratio", "parameter compression ratio"),
    ("wire_bytes", "bytes this step"),
]
fig, axs = plt.subplots(len(keys), 1, figsize=(8, 8), sharex=True)
for ax, (key, label) in zip(axs, keys):
    pts = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
    if pts:
        ax.step(*zip(*pts), where="post")
    ax.set_ylabel(label, fontsize=8)
    ax.grid(alpha=0.3)
axs[-1].set_xlabel("step")
fig.tight_layout()
display(fig)  # inline: the figure is in the saved notebook (tests run it under Agg)
plt.close(fig)

# %% [markdown]
# The phase switches from full-rank warm-up to group training; at each sync the ranks are
# re-chosen by the cutoff (the mean rank and the compression ratio move), and the bytes per step
# drop during the AB phases. `docs/results/ab_training/` compares accuracy and traffic with
# plain data parallelism over whole runs.
