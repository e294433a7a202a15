r"""Issue 35's blow-up remedy: TopK 10% of the activations by token rows (``row_axis=-1``: each
token's feature vector keeps its own 10%, so no token row is sent all zero) against paper 1's
per-sample TopK 10% (which zeroes whole token rows), with Adam and SGD-momentum.

  python -m jaxcomp.study run text_paper1_rowtopk --workdir runs/text_paper1_rowtopk
  python -m jaxcomp.study report runs/text_paper1_rowtopk

The setting of ``text_paper1_feedback``'s plain ``topk10`` cells, where per-sample TopK blew up
(pre-clipping gradient norms 1e8-1e10; its dense cells: 8.00 / 10.19 ppl): the byte-level GPT of
``configs/text_gpt_pipeline.py`` in 4 pipeline stages on 8 fake CPU devices, the training split
cut to 3,200 windows, 150 steps of 64, activation-gradients uncompressed
(``backward_mode = "independent"``). Adam lr 3e-3, SGD-momentum lr 0.1, constant, gradient
clipping 1.0; evaluated and checkpointed every 75 steps. 2 variants x 2 optimizers x 2 seeds =
8 runs; the dense baseline is ``text_paper1_feedback``'s (the same cells).

Expected runtime: ~10 min on 2 shared CPU cores (measured: 571 s for the 8 runs at load average
3.0-7.2, without a compilation cache; 44-53 s per run). ``--smoke``: 8 runs of 2 steps.
Results: docs/results/text_paper1_rowtopk.

Finding tested (not a paper's: TopK by rows is a variant): a TopK that never zeroes a whole token
row trains the GPT where per-sample TopK blows up (paper 1's GPT-2 summary: independent
compression of activations and gradients "may lead to divergence"), at no more bytes.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "text_gpt_pipeline"
COMMON = {
    "total_steps": 150,
    "eval_every": 75,
    "checkpoint_every": 75,
    "log_every": 25,
    "data.max_train_windows": 3200,
    "pipeline.backward_mode": "independent",
}
VARIANTS = {
    "topk10": {"pipeline.forward": {"name": "top_k", "fraction": 0.1, "per_sample": True}},
    "topk10 rows": {"pipeline.forward": {"name": "top_k", "fraction": 0.1, "row_axis": -1}},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "topk10"
