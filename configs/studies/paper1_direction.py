r"""Paper 1, compression direction: TopK and quantization on activations only, on activation-
gradients only, and on both, against an uncompressed pipeline, with Adam and SGD-momentum.

  python -m jaxcomp.study run paper1_direction --workdir runs/paper1_direction
  python -m jaxcomp.study report runs/paper1_direction

The digits MLP (64-256-256-256-10) cut into 4 pipeline stages on 8 fake CPU devices
(``configs/digits_pipeline.py``), 400 steps, evaluated every 100 steps with compression on and
off; TopK keeps 10% per sample, quantization sends 2-bit codes with a per-feature fp16 scale;
7 variants x 2 optimizers x 2 seeds = 28 runs.

Expected runtime: 319 s (5.3 min) measured for the whole study on 2 shared CPU cores (load
average 0.6 at the start, rising to ~5; docs/results/paper1_direction/report.md).
``--smoke``: 28 runs of 2 steps, ~2 minutes.

Finding tested (Rudakov et al., 2024, abstract; SPEC.md section 1.1): gradients need milder
compression than activations, i.e. compressing only the backward hurts more than compressing
only the forward at the same codec; and, for quantization, "gradients are more sensitive than
activations". Whether the ordering depends on the optimizer is the second question.
"""

from jaxcomp.study import direction_presets
from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline"
COMMON = {"total_steps": 400, "eval_every": 100, "checkpoint_every": 100, "log_every": 25}
TOPK = {"name": "top_k", "fraction": 0.1, "per_sample": True}
QUANTIZE = {"name": "quantize", "bits": 2, "scale": "feature"}
VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward": "identity"},
    **{f"topk10 {p}": o for p, o in direction_presets(TOPK).items()},
    **{f"quant2 {p}": o for p, o in direction_presets(QUANTIZE).items()},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "dense"
