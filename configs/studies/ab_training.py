r"""AB-Training against data parallelism: traffic per step and per cycle, accuracy, and the
parameter compression ratio, with Adam and SGD-momentum.

  python -m jaxcomp.study run ab_training --workdir runs/ab_training
  python -m jaxcomp.study report runs/ab_training

The digits MLP on 8 fake CPU devices (``configs/digits_ab.py``): AB-Training in 2 groups of 4
(60 full-rank warm-up steps, then independent low-rank group training with a ``with-stale`` sync
every 40 steps and 5 full-rank steps after each, cutoff 0.15, rank capacity 64 of 256, first
layer and classifier full-rank) against plain data parallelism (``mode = "dense"``: one
float32 all-reduce of the gradients per step), 220 steps (two AB cycles after warm-up),
evaluated every 110 steps. The report's bytes per step are the mean over the run's steps (the
AB mode reports each step by its kind: full-rank, AB, sync); its state plot shows the phase,
the mean rank and the parameter compression ratio over time. 2 variants x 2 optimizers x 2
seeds = 8 runs.

Expected runtime: ~40 s on 2 idle cores (see docs/results/studies_runtime.md).
``--smoke``: 8 runs of 2 steps.

Findings tested (Coquelin et al., 2024, abstract; SPEC.md section 3.1): AB-Training reduces
network traffic by 50% (v1) / ~70% (v2) against data parallelism at competitive accuracy; it
reaches a 44.14:1 parameter compression ratio on VGG-16 / CIFAR-10.
"""

CONFIG = "digits_ab"
COMMON = {"total_steps": 220, "eval_every": 110, "checkpoint_every": 110, "log_every": 10}
VARIANTS = {
    "data-parallel": {"mode": "dense", "mesh": [("data", 8)]},
    "ab-training": {},
}
AXES = {
    "optimizer": {
        "adam": {"ab.inner": "adam", "optax_name": "adam", "optax": {}, "lr": 1e-3},
        "sgdm": {"ab.inner": "sgd", "optax_name": "sgd", "optax": {"momentum": 0.9}, "lr": 0.05},
    }
}
SEEDS = (0, 1)
BASELINE = "data-parallel"
