r"""AB-Training on a language model against data parallelism: perplexity, traffic per step and
per cycle, and the parameter compression ratio over training, with Adam and SGD-momentum.

  python -m jaxcomp.study run text_ab_training --workdir runs/text_ab_training
  python -m jaxcomp.study report runs/text_ab_training

The byte-level GPT on 8 fake CPU devices (``configs/text_gpt_ab.py``): AB-Training in 2 groups
of 4 (60 full-rank warm-up steps, then independent low-rank group training with a
``with-stale`` sync every 40 steps and 5 full-rank steps after each, cutoff 0.15 with no rank
capacity cap, so the cutoff alone sets each rank) against plain data parallelism (``mode =
"dense"``: one float32 all-reduce of the gradients per step), 300 steps, evaluated every 150
on the validation split. The report's state plot shows the phase, the mean rank of the
factorised weights and the parameter compression ratio over time. Adam lr 3e-3, SGD-momentum
lr 0.1, constant, gradients clipped at 1.0. 2 variants x 2 optimizers x 2 seeds = 8 runs.

Why this model: on the digits MLP the cutoff never dropped a rank below the capacity of 64
(docs/results/ab_training). On this GPT, exploratory single-seed runs of 300 steps dropped the
factorised weights' mean rank from 64 to 59.9 (Adam) while the factored model held more
parameters than the dense one (compression ratio 0.85-0.88: at rank r of a 64 x 64 matrix,
r (m + n) < m n only for r < 32); a 1024-wide digits MLP went from rank 1024 to 508 in 300
steps, ratio 1.02 (docs/results/text_exploration.md).

Expected runtime: ~6 min on 2 shared CPU cores (measured: 349 s for the 8 runs, 36-52 s each,
load average 4-7). ``--smoke``: 8 runs of 2 steps.

Findings tested (Coquelin et al., 2024, abstract; SPEC.md section 3.1): AB-Training reduces
network traffic by 50% (v1) / ~70% (v2) against data parallelism at competitive accuracy; it
reaches a 44.14:1 parameter compression ratio on VGG-16 / CIFAR-10.
"""

CONFIG = "text_gpt_ab"
COMMON = {"total_steps": 300, "eval_every": 150, "checkpoint_every": 150, "log_every": 10}
VARIANTS = {
    "data-parallel": {"mode": "dense", "mesh": [("data", 8)], "grad_clip_norm": 1.0},
    "ab-training": {},
}
AXES = {
    "optimizer": {
        "adam": {"ab.inner": "adam", "optax_name": "adam", "optax": {}, "lr": 3e-3},
        "sgdm": {"ab.inner": "sgd", "optax_name": "sgd", "optax": {"momentum": 0.9}, "lr": 0.1},
    }
}
SEEDS = (0, 1)
BASELINE = "data-parallel"
