"""Diagnostic for the excess gradient norm of TopK by rows with Adam (not a test, not a study).

``text_paper1_rowtopk``'s Adam runs by rows kept a pre-clipping gradient norm 4-60x dense's, and
``blowup_probe.py`` put the excess in stage 0. For each checkpoint of the 4-stage GPT pipeline
given, on ``blowup_probe.py``'s 512 training windows, prints the global norm of the parameter
gradient and each stage's, with TopK 10% by rows at every boundary (straight-through backward,
``"independent"``'s; and the gradient sent back at the kept positions only, ``"shared_mask"``'s),
at one boundary only, and dense; then stage 0's largest leaves for dense and by rows.

  PYTHONPATH=. tools/cpu-slot python docs/results/text_paper1_rowtopk_feedback/stage0_probe.py \
      runs/text_paper1_rowtopk/topk10-rows__optimizer=adam__seed0/checkpoints/150/state [...]

Since 2026-12-05 (branch ``stagenorm``) the trainer's pipeline mode logs each stage's gradient
norm itself (``grad_norm/stage_0`` ... ``grad_norm/stage_{S-1}`` beside ``grad_norm`` in
``metrics.jsonl``, ``train.csv`` and TensorBoard; the norm of the step's own gradient, with the
links as trained, before clipping, each record the mean over its steps): a run shows where its
excess is without this probe. The probe still gives what a run does not: one fixed set of 512
windows at a checkpoint, and the same weights with dense links or the other backward.
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
fns = model.stage_fns(train=True)
docs = pydoc_documents()
w = token_windows(np.frombuffer(b"".join(docs[k] for k in sorted(docs)), np.uint8), 32)
w = w[::23][:512]
x, y = jnp.asarray(w[:, :-1], jnp.int32), jnp.asarray(w[:, 1:], jnp.int32)
rows = compressors.top_k(0.1, row_axis=-1)


def send(a, how):
    """0: dense; 1: by rows, straight-through (the trained mode); 2: by rows, the gradient at
    the kept positions only (``"shared_mask"``)."""
    c = rows.decompress(rows.compress(a, (), None)[0], a)
    kept = a * jax.lax.stop_gradient(c != 0)
    return jnp.where(how == 2, kept, a + jax.lax.stop_gradient(jnp.where(how == 1, c, a) - a))


@jax.jit
def value_and_grad(params, where):
    def loss(params):
        a = fns[0](params[0], x)
        for s in (1, 2, 3):
            a = fns[s](params[s], send(a, where[s - 1]))
        return models.cross_entropy(a, y)

    return jax.value_and_grad(loss)(params)


def norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(tree))))


cases = {"dense": (0, 0, 0), "rows": (1, 1, 1), "rows, gradient at the kept positions": (2, 2, 2)}
cases.update({f"rows at boundary {b} only": tuple(int(i == b) for i in range(3)) for b in range(3)})
for path in sys.argv[1:]:
    print(f"== {path}")
    packed = ocp.StandardCheckpointer().restore(os.path.abspath(path))["mode_state"]["params"][0]
    stages = [s["params"] for s in layout.unpack({"float32": jnp.asarray(packed)})]
    leaves = {}
    for name, where in cases.items():
        value, grads = value_and_grad(stages, jnp.asarray(where))
        per_stage = ", ".join(f"{norm(s):.3g}" for s in grads)
        print(f"{name}: loss {float(value):.4f}, |grad| {norm(grads):.4g} (per stage {per_stage})")
        flat = jax.tree_util.tree_flatten_with_path(grads[0])[0]
        leaves[name] = {jax.tree_util.keystr(p): float(jnp.linalg.norm(g.ravel())) for p, g in flat}
    top = sorted(leaves["rows"], key=leaves["rows"].get, reverse=True)[:6]
    for k in top:
        print(f"stage 0 {k}: rows {leaves['rows'][k]:.3g}, dense {leaves['dense'][k]:.3g}")
