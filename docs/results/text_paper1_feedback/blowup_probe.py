"""Diagnostic for the gradient blow-up of activations-only TopK (not a test, not a study).

What ``independent`` mode trains with, on one batch: each boundary's receiver computes on the
per-sample TopK 10% of the activation, and the gradient it sends back is used by the sender as
the gradient of its dense output (straight-through). For a checkpoint of the 4-stage GPT
pipeline, on 512 training windows, prints per boundary the share of token rows that TopK leaves
all zero and the smallest standard deviation of a row that is not, then the global norm of the
parameter gradient (what gradient clipping sees, before it) and each stage's share:

* ``dense``: no compression;
* ``topk``: TopK at every boundary, straight-through backward (the trained mode);
* ``topk, zero rows dense``: the same, but a token row that TopK leaves all zero is sent dense
  (the rest of the sample stays TopK'd): if the blow-up is LayerNorm's ``1/sqrt(var + 1e-6)``
  on all-zero rows (1e3 per boundary, compounding through the residual stream), this removes it.
* ``topk by rows``: TopK 10% of each token row (``compressors.top_k(0.1, row_axis=-1)``, the
  remedy of ``text_paper1_rowtopk``), straight-through backward.

  PYTHONPATH=. tools/cpu-slot python docs/results/text_paper1_feedback/blowup_probe.py \
      runs/text_paper1_aqsgd_warmup/topk10-warm__optimizer=adam__seed0/checkpoints/150/state
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxcomp import compressors
from jaxcomp import models
from jaxcomp.data._text import pydoc_documents
from jaxcomp.data._text import token_windows
from jaxcomp.pipeline._params import param_layout

model = models.gpt(256, 32, dim=64, num_blocks=4, num_heads=4, cuts=("block0", "block1", "block2"))
layout = param_layout(model.init(jax.random.key(0)))
packed = ocp.StandardCheckpointer().restore(os.path.abspath(sys.argv[1]))["mode_state"]["params"][0]
stages = [s["params"] for s in layout.unpack({"float32": jnp.asarray(packed)})]
fns = model.stage_fns(train=True)
docs = pydoc_documents()
w = token_windows(np.frombuffer(b"".join(docs[k] for k in sorted(docs)), np.uint8), 32)
w = w[::23][:512]
x, y = jnp.asarray(w[:, :-1], jnp.int32), jnp.asarray(w[:, 1:], jnp.int32)


def topk(a, fraction=0.1):
    flat = a.reshape(a.shape[0], -1)
    pivot = jax.lax.top_k(jnp.abs(flat), int(fraction * flat.shape[1]))[0][:, -1:]
    return jnp.where(jnp.abs(flat) >= pivot, flat, 0).reshape(a.shape)


rows = compressors.top_k(0.1, row_axis=-1)


def send(a, how):
    if how == "dense":
        return a
    if how == "topk by rows":
        return a + jax.lax.stop_gradient(rows.decompress(rows.compress(a, (), None)[0], a) - a)
    c = topk(a)
    if how == "topk, zero rows dense":
        c = jnp.where(jnp.all(c == 0, axis=-1, keepdims=True), a, c)
    return a + jax.lax.stop_gradient(c - a)  # the receiver's input; the sender's gradient as is


def loss(params, how):
    a = fns[0](params[0], x)
    for s in (1, 2, 3):
        a = fns[s](params[s], send(a, how))
    return models.cross_entropy(a, y)


a = fns[0](stages[0], x)
for b in (1, 2, 3):
    c = topk(a)
    zero = jnp.all(c == 0, axis=-1)
    std = jnp.std(c, axis=-1)
    where, count = np.unique(np.nonzero(zero)[1], return_counts=True)
    print(
        f"boundary {b - 1}: zero rows {float(jnp.mean(zero)):.4f} ({int(jnp.sum(zero))}); "
        f"smallest std of a nonzero row {float(jnp.min(jnp.where(zero, jnp.inf, std))):.3g}; "
        f"zero rows by position {dict(zip(where.tolist(), count.tolist()))}"
    )
    a = fns[b](stages[b], c)
for how in ("dense", "topk", "topk, zero rows dense", "topk by rows"):
    value, grads = jax.value_and_grad(loss)(stages, how)
    per_stage = [float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(s)))) for s in grads]
    total = float(np.sqrt(sum(n**2 for n in per_stage)))
    shares = ", ".join(f"{n:.3g}" for n in per_stage)
    print(f"{how}: loss {float(value):.4f}, |grad| {total:.4g} (per stage {shares})")
