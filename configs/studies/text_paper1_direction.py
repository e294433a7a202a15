r"""Paper 1, compression direction on a language model: TopK 10% and 2-bit quantization on the
activations only and on the activation-gradients only, against an uncompressed pipeline, with
Adam and SGD-momentum.

  python -m jaxcomp.study run text_paper1_direction --workdir runs/text_paper1_direction
  python -m jaxcomp.study report runs/text_paper1_direction

The byte-level GPT of ``configs/text_gpt_pipeline.py`` (4 blocks of width 64, context 32) cut
into 4 pipeline stages on 8 fake CPU devices (2 replicas), on Python's bundled help text split
by document; 150 steps of 64 windows (0.75 epoch), evaluated every 75 steps on the validation
split with compression on and off (loss, next-byte accuracy, perplexity). TopK keeps 10% of each
sample's ``[32, 64]`` activation (the compressed direction chosen independently of the other:
``backward_mode = "independent"``); quantization sends 2-bit codes with a per-feature fp16
scale. Adam lr 3e-3, SGD-momentum lr 0.1, both constant with gradient clipping 1.0; 5 variants x
2 optimizers x 2 seeds = 20 runs.

Expected runtime: ~10 min on 2 shared CPU cores (measured: 539 s for the 20 runs at load
average 3-5, without a compilation cache). ``--smoke``: 20 runs of 2
steps. Results: docs/results/text_paper1_direction.

Finding tested (Rudakov et al., 2024, abstract; SPEC.md section 1.1): gradients need milder
compression than activations, i.e. compressing only the backward hurts more than compressing
only the forward at the same codec; for quantization "gradients are more sensitive than
activations". The digits MLP reproduced it (docs/results/paper1_direction); an earlier quick
check on a tiny GPT found it reversed for a language model.
"""

from jaxcomp.study import direction_presets
from jaxcomp.study import optimizer_axis

CONFIG = "text_gpt_pipeline"
COMMON = {
    "total_steps": 150,
    "eval_every": 75,
    "checkpoint_every": 75,
    "log_every": 25,
    "pipeline.backward_mode": "independent",
}
TOPK = {"name": "top_k", "fraction": 0.1, "per_sample": True}
QUANTIZE = {"name": "quantize", "bits": 2, "scale": "feature"}
VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward": "identity"},
    **{f"topk10 {p}": o for p, o in direction_presets(TOPK).items() if p != "both"},
    **{f"quant2 {p}": o for p, o in direction_presets(QUANTIZE).items() if p != "both"},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "dense"
