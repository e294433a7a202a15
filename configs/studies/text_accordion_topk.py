r"""Accordion on a language model, the TopK pair: static TopK 10% (low compression only), static
TopK 1% (high compression only) and Accordion switching per layer between them, with Adam and
SGD-momentum.

  python -m jaxcomp.study run text_accordion_topk --workdir runs/text_accordion_topk
  python -m jaxcomp.study report runs/text_accordion_topk

The byte-level GPT on 8 data-parallel fake CPU devices (``configs/text_gpt_accordion.py`` with
TopK codecs): TopK keeps the largest 10% / 1% of each layer's gradient entries, error feedback
on; 200 steps of 64 windows, the detector's interval 20 steps, checked every 2 intervals, eta
0.5; the static variants are Accordion with the same codec on both sides. Evaluated every 100
steps on the validation split. Adam lr 3e-3, SGD-momentum lr 0.1, constant, gradient clipping
1.0. 3 variants x 2 optimizers x 2 seeds = 12 runs.

Why these levels: on the digits MLP TopK 10% already matched dense and even TopK 0.1% with
error feedback kept 98% accuracy with SGD-momentum (no gap to close;
docs/results/text_exploration.md). On this GPT, exploratory single-seed runs of 200 steps gave
validation perplexity 12.5 (TopK 1%) vs 8.9 (TopK 10%) with Adam and 14.8 vs 10.4 with
SGD-momentum: 1% alone is 40-43% worse.

Expected runtime: ~11 min on 2 shared CPU cores (measured: 678 s for the 12 runs, 46-77 s
each, load average 3-7). ``--smoke``: 12 runs of 2 steps.

Finding tested (Agarwal et al., 2021, abstract; SPEC.md sections 2.1, 2.6): Accordion reaches
the accuracy of low compression while sending close to the bytes of high compression (the
authors' CIFAR-10 pair was TopK 99% / 10%).
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
LOW = {"name": "top_k", "fraction": 0.1}
HIGH = {"name": "top_k", "fraction": 0.01}
VARIANTS = {
    "topk10 (low only)": {"data_parallel.low": LOW, "data_parallel.high": LOW},
    "topk1 (high only)": {"data_parallel.low": HIGH, "data_parallel.high": HIGH},
    "accordion 10/1": {"data_parallel.low": LOW, "data_parallel.high": HIGH},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "topk10 (low only)"
