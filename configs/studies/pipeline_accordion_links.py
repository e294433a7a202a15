r"""Accordion on pipeline links: fixed 8-bit links (low compression), fixed 4-bit links (high
compression) and adaptive links switching each boundary and direction between them by
Accordion's detector, with Adam and SGD-momentum.

  python -m jaxcomp.study run pipeline_accordion_links --workdir runs/pipeline_accordion_links
  python -m jaxcomp.study report runs/pipeline_accordion_links

The digits MLP (64-256-256-256-10) cut into 4 pipeline stages with 2 data replicas on 8 fake
CPU devices (``configs/digits_pipeline_accordion.py``): activations as 8-bit or 4-bit codes with
one fp16 scale per feature, activation-gradients as 8-bit or 4-bit codes; the detector's
interval is one epoch (11 steps), checked every 2 intervals, eta 0.5, the first interval
critical. 400 steps, evaluated every 100 with compression on and off. 3 variants x 2 optimizers
x 2 seeds = 12 runs.

Expected runtime: 255 s (4.3 min) of runs measured for the whole study on 2 shared CPU cores
(load average ~5.5; 13-19 s per fixed run, 24-42 s per adaptive run, which compiles one program
per mode combination it meets; docs/results/pipeline_accordion_links/report.md).
``--smoke``: 12 runs of 2 steps.

Finding tested (beyond the papers: issue 15; Agarwal et al., 2021, applied to Rudakov et al.,
2024's pipeline links): Accordion's detector, choosing each boundary's compression level from
the norms it sends, reaches the low-compression (8-bit) accuracy at close to the
high-compression (4-bit) bytes, as Accordion does for data-parallel gradients.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline_accordion"
COMMON = {"total_steps": 400, "eval_every": 100, "checkpoint_every": 100, "log_every": 25}
FIXED = {"pipeline.forward_high": None, "pipeline.backward_high": None, "pipeline.detector": None}
VARIANTS = {
    "fixed 8-bit (low)": FIXED,
    "fixed 4-bit (high)": {
        **FIXED,
        "pipeline.forward.bits": 4,
        "pipeline.backward.bits": 4,
    },
    "adaptive 8/4": {},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "fixed 8-bit (low)"
