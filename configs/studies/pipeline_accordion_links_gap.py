r"""Accordion on pipeline links where high compression alone loses accuracy: fixed 8-bit links
(low compression), fixed links of 2-bit activations and 4-bit activation-gradients (high
compression) and adaptive links switching each boundary and direction between them by
Accordion's detector, with Adam and SGD-momentum.

  python -m jaxcomp.study run pipeline_accordion_links_gap --workdir runs/links_gap
  python -m jaxcomp.study report runs/links_gap

As ``pipeline_accordion_links`` (the digits MLP cut into 4 stages with 2 data replicas on 8 fake
CPU devices, ``configs/digits_pipeline_accordion.py``; interval one epoch of 11 steps, checked
every 2 intervals, eta 0.5; 400 steps, evaluated every 100 with compression on and off), but
the high level is 2-bit activations / 4-bit gradients instead of 4-bit / 4-bit: 4-bit alone
matched 8-bit (docs/results/pipeline_accordion_links), so there was no gap to close. In
exploratory single-seed runs of 400 steps the 2/4-bit links reached 0.947 (Adam) and 0.961
(SGD-momentum) with compression on, against 0.985 / 0.981 for 8-bit: 2-4 points lower
(docs/results/text_exploration.md). 3 variants x 2 optimizers x 2 seeds = 12 runs.

Expected runtime: ~4-5 min on 2 shared CPU cores (measured: 262 s at load average 8.5-9.9,
without a compilation cache; 13-16 s per fixed run, 27-40 s per adaptive run). ``--smoke``: 12
runs of 2 steps.
Results: docs/results/pipeline_accordion_links_gap.

Finding tested (beyond the papers: issue 15; Agarwal et al., 2021, applied to Rudakov et al.,
2024's pipeline links): the detector, choosing each boundary's level from the norms it sends,
reaches the low-compression (8-bit) accuracy at close to the high-compression bytes.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline_accordion"
COMMON = {
    "total_steps": 400,
    "eval_every": 100,
    "checkpoint_every": 100,
    "log_every": 25,
}
FIXED = {"pipeline.forward_high": None, "pipeline.backward_high": None, "pipeline.detector": None}
VARIANTS = {
    "fixed 8-bit (low)": FIXED,
    "fixed 2/4-bit (high)": {**FIXED, "pipeline.forward.bits": 2, "pipeline.backward.bits": 4},
    "adaptive 8/8 <-> 2/4": {"pipeline.forward_high.bits": 2, "pipeline.backward_high.bits": 4},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "fixed 8-bit (low)"
