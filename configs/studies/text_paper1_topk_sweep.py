r"""Paper 1, the TopK level sweep on a language model: TopK on the activations keeping 50, 20,
10 and 5% of each sample's values, the backward reusing the forward mask (paper 1's GPT-2
hooks), against an uncompressed pipeline, with Adam and SGD-momentum; evaluation with
compression on and off (the report's two accuracy columns: "inference with compression on vs
off").

  python -m jaxcomp.study run text_paper1_topk_sweep --workdir runs/text_paper1_topk_sweep
  python -m jaxcomp.study report runs/text_paper1_topk_sweep

The byte-level GPT of ``configs/text_gpt_pipeline.py`` (4 blocks of width 64, context 32) cut
into 4 pipeline stages on 8 fake CPU devices, on Python's bundled help text split by document;
150 steps (0.75 epoch), evaluated every 75 steps on the validation split (loss, next-byte
accuracy, perplexity). Adam lr 3e-3, SGD-momentum lr 0.1, constant, gradient clipping 1.0; 5
variants x 2 optimizers x 2 seeds = 20 runs.

Expected runtime: ~13 min on 2 idle cores (see docs/results/text_paper1_topk_sweep/README.md).
``--smoke``: 20 runs of 2 steps. Results: docs/results/text_paper1_topk_sweep.

Findings tested (Rudakov et al., 2024, abstract and its GPT-2 results as summarised, SPEC.md
section 1.1): K = 10% is the lowest TopK level that does not severely harm convergence; on
GPT-2 TopK "starts to increase loss from Top20%"; models trained with TopK perform well only
if compression is also applied at inference (the "off" columns drop).
"""

from jaxcomp.study import optimizer_axis

CONFIG = "text_gpt_pipeline"
COMMON = {"total_steps": 150, "eval_every": 75, "checkpoint_every": 75, "log_every": 25}
LEVELS = (0.5, 0.2, 0.1, 0.05)


def _topk(fraction):
    return {"pipeline.forward": {"name": "top_k", "fraction": fraction, "per_sample": True}}


VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward_mode": "independent"},
    **{f"topk{round(f * 100)} shared-mask": _topk(f) for f in LEVELS},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "dense"
