r"""AB-Training on the small GPT: 8 workers in 2 groups of 4 train the decoder's factors
independently (Coquelin et al., 2024), on Python's bundled text.

The model, data and learning rate of ``text_gpt_dense`` (Adam inside AB-Training, lr 3e-3
constant, the averaged gradients clipped at 1.0). After 60 full-rank warm-up steps every
block's attention output projection and MLP matrices (64 x 64, 64 x 256, 256 x 64: full rank
64) are factorised ``W = A B`` by SVD, keeping the singular values above 0.15 of the largest
(no rank capacity cap), and the groups train them independently, syncing every 40 steps
(``with-stale``) with 5 full-rank steps after each. Kept dense: the embeddings, the head, and
the per-head query/key/value kernels ``(64, 4, 16)`` with their ``(4, 16)`` biases, whose 2-D
views (``(256, 16)``, ``(4, 16)``) are not the projections' matrices.

  python -m jaxcomp.main --config configs/text_gpt_ab.py --workdir runs/text_gpt_ab

Expected: under a minute on 2 shared CPU cores (300 steps, 42 s at load average ~4.5);
validation perplexity 6.74 at step 300, 9.02 at 150 (Adam; the dense ``text_gpt_dense``: 6.76
at step 200, 5.05 at 400; unigram 26.1), the factorised weights' mean rank 64 -> ~60 (the
cutoff drops ranks), the factored model 0.85-0.88x the dense parameter count (at width 64 a
rank-r factor pair is smaller only for r < 32), 805.30 KiB per step against 917.51 KiB for data
parallelism, 15% less over an AB cycle (docs/results/text_exploration.md, "AB-Training").
``:smoke``: one block, 2 steps.
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    smoke = arg == "smoke"
    base = pathlib.Path(__file__).with_name("text_gpt_dense.py")
    c = load_config(f"{base}" + (f":{arg}" if arg else ""))
    c.mode = "ab"
    c.mesh = [("group", 2), ("member", 4)]
    c.ab = dict(
        warmup_steps=1 if smoke else 60,
        sync_every=2 if smoke else 40,
        full_rank_steps=1 if smoke else 5,
        sync_mode="with-stale",
        low_rank_cutoff=0.15,
        exclude=("embed", "head", "query", "key", "value", "bias"),
        inner="adam",
        max_grad_norm=1.0,
    )
    c.total_steps = 2 if smoke else 300  # the AB study's length
    c.eval_every = 0 if smoke else 150
    c.checkpoint_every = 0 if smoke else 150
    c.grad_clip_norm = None  # AB clips the averaged trained gradients itself (ab.max_grad_norm)
    return c
