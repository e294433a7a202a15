r"""Accordion on a language model, the PowerSGD pair: static rank 4 (low compression only),
static rank 1 (high compression only) and Accordion switching per layer between them, with Adam
and SGD-momentum.

  python -m jaxcomp.study run text_accordion_powersgd --workdir runs/text_accordion_powersgd
  python -m jaxcomp.study report runs/text_accordion_powersgd

The byte-level GPT on 8 data-parallel fake CPU devices (``configs/text_gpt_accordion.py``):
200 steps of 64 windows, the detector's interval 20 steps, checked every 2 intervals, eta 0.5,
error feedback on; the static variants are Accordion with the same codec on both sides (the
same error feedback, the same bytes accounting). Evaluated every 100 steps on the validation
split. Adam lr 3e-3, SGD-momentum lr 0.1, constant (Accordion's detector reads the schedule),
gradient clipping 1.0. 3 variants x 2 optimizers x 2 seeds = 12 runs.

Why these levels: on the digits MLP rank 1 matched rank 2, so there was no gap to close
(docs/results/accordion_powersgd). On this GPT, exploratory single-seed runs of 200 steps gave
validation perplexity 12.4 (rank 1) vs 9.3 (rank 4) with Adam and 14.3 vs 10.9 with
SGD-momentum: rank 1 alone is 31-34% worse (docs/results/text_exploration.md).

Expected runtime: ~12 min on 2 idle cores (see docs/results/text_accordion_powersgd/README.md).
``--smoke``: 12 runs of 2 steps. Results: docs/results/text_accordion_powersgd.

Finding tested (Agarwal et al., 2021, abstract; SPEC.md sections 2.1, 2.6): Accordion reaches
the accuracy of low compression (rank 4 here) while sending close to the bytes of high
compression (rank 1).
"""

from jaxcomp.study import optimizer_axis

CONFIG = "text_gpt_accordion"
COMMON = {
    "total_steps": 200,
    "eval_every": 100,
    "checkpoint_every": 100,
    "log_every": 20,
    "data_parallel.interval_steps": 20,
}
LOW = {"name": "power_sgd", "rank": 4}
HIGH = {"name": "power_sgd", "rank": 1}
VARIANTS = {
    "rank4 (low only)": {"data_parallel.low": LOW, "data_parallel.high": LOW},
    "rank1 (high only)": {"data_parallel.low": HIGH, "data_parallel.high": HIGH},
    "accordion 4/1": {"data_parallel.low": LOW, "data_parallel.high": HIGH},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "rank4 (low only)"
