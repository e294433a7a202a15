"""Diagnostic for the gradient blow-up of activations-only TopK (not a test, not a study).

For a checkpoint of the 4-stage GPT pipeline (``configs/text_gpt_pipeline.py``'s model), runs
128 windows of the training text through the stages and, at each boundary, prints the share of
token rows that per-sample TopK 10% leaves all zero, and the norm of the gradient of the
downstream loss (the later stages, uncompressed) w.r.t. the boundary activation, at the dense
activation and at its TopK'd copy (what the next stage computes on in ``independent`` mode).

  PYTHONPATH=. tools/cpu-slot python docs/results/text_paper1_feedback/zero_rows.py \
      runs/text_paper1_feedback/dense__optimizer=adam__seed0/checkpoints/150/state
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxcomp import models
from jaxcomp.data._text import pydoc_documents
from jaxcomp.data._text import token_windows
from jaxcomp.pipeline._params import param_layout

model = models.gpt(256, 32, dim=64, num_blocks=4, num_heads=4, cuts=("block0", "block1", "block2"))
layout = param_layout(model.init(jax.random.key(0)))
packed = ocp.StandardCheckpointer().restore(sys.argv[1])["mode_state"]["params"][0]
stages = [s["params"] for s in layout.unpack({"float32": jnp.asarray(packed)})]
fns = model.stage_fns(train=False)
docs = pydoc_documents()
w = token_windows(np.frombuffer(b"".join(docs[k] for k in sorted(docs)), np.uint8), 32)
w = w[::97][:128]
x, y = jnp.asarray(w[:, :-1], jnp.int32), jnp.asarray(w[:, 1:], jnp.int32)


def topk(a, fraction=0.1):
    flat = a.reshape(a.shape[0], -1)
    pivot = jax.lax.top_k(jnp.abs(flat), int(fraction * flat.shape[1]))[0][:, -1:]
    return jnp.where(jnp.abs(flat) >= pivot, flat, 0).reshape(a.shape)


def downstream(a, first):
    for s in range(first, 4):
        a = fns[s](stages[s], a)
    return models.cross_entropy(a, y)


a = fns[0](stages[0], x)
for b in (1, 2, 3):
    c = topk(a)
    zero = float(jnp.mean(jnp.all(c == 0, axis=-1)))
    dense, sparse = (float(jnp.linalg.norm(jax.grad(downstream)(v, b))) for v in (a, c))
    print(f"boundary {b - 1}: zero rows {zero:.3f}; |dL/da| dense {dense:.3g}, TopK {sparse:.3g}")
    a = fns[b](stages[b], a)
