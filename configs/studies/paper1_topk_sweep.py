r"""Paper 1, the TopK level sweep: TopK on the activations and on the activation-gradients
(both directions) keeping 50, 30, 20, 10, 5 and 2% of each sample's values, against an
uncompressed pipeline, with Adam and SGD-momentum; evaluation with compression on and off
(the report's two accuracy columns: the paper's "inference with compression on vs off").

  python -m jaxcomp.study run paper1_topk_sweep --workdir runs/paper1_topk_sweep
  python -m jaxcomp.study report runs/paper1_topk_sweep

The digits MLP (64-256-256-256-10) cut into 4 pipeline stages on 8 fake CPU devices
(``configs/digits_pipeline.py``), 400 steps, evaluated every 100 steps; 7 variants x 2
optimizers x 2 seeds = 28 runs.

Expected runtime: 363 s (6.1 min) measured for the whole study on 2 shared CPU cores (load
average 5.9-6.7; docs/results/paper1_topk_sweep/report.md). ``--smoke``: 28 runs of 2 steps.

Findings tested (Rudakov et al., 2024, abstract; SPEC.md section 1.1): K = 10% is the lowest
TopK level that does not severely harm convergence; models trained with TopK perform well only
if compression is also applied at inference (accuracy with compression off drops).
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline"
COMMON = {"total_steps": 400, "eval_every": 100, "checkpoint_every": 200, "log_every": 50}
LEVELS = (0.5, 0.3, 0.2, 0.1, 0.05, 0.02)


def _topk(fraction):
    codec = {"name": "top_k", "fraction": fraction, "per_sample": True}
    return {"pipeline.forward": codec, "pipeline.backward": codec}


VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward": "identity"},
    **{f"topk{round(f * 100)}": _topk(f) for f in LEVELS},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "dense"
