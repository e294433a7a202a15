r"""Accordion, the PowerSGD pair: static rank 2 (low compression only), static rank 1 (high
compression only) and Accordion switching per layer between them, against dense data
parallelism, with SGD-momentum and Adam.

  python -m jaxcomp.study run accordion_powersgd --workdir runs/accordion_powersgd
  python -m jaxcomp.study report runs/accordion_powersgd

The digits MLP on 8 data-parallel fake CPU devices (``configs/digits_accordion.py``): 300 steps
(27 epochs of 11 steps), detector checked every 2 epochs, eta 0.5, error feedback on; the static
variants are Accordion with the same codec on both sides (the same error feedback, the same
bytes accounting). 4 variants x 2 optimizers x 2 seeds = 16 runs.

Expected runtime: 196 s (3.3 min) measured for the whole study on 2 shared CPU cores (load
average 5.9-6.0; docs/results/accordion_powersgd/report.md). ``--smoke``: 16 runs of 2 steps.

Finding tested (Agarwal et al., 2021, abstract; SPEC.md sections 2.1, 2.6): Accordion reaches
the accuracy of low compression (rank 2) while sending close to the bytes of high compression
(rank 1); the authors' CIFAR-10 ResNet-18 logs: rank 2 94.49%, rank 1 94.25%, Accordion 94.72%.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_accordion"
COMMON = {"total_steps": 300, "eval_every": 100, "checkpoint_every": 100, "log_every": 25}
LOW = {"name": "power_sgd", "rank": 2}
HIGH = {"name": "power_sgd", "rank": 1}
VARIANTS = {
    "dense": {"data_parallel.transform": "compressed_mean", "data_parallel.codec": "identity"},
    "rank2 (low only)": {"data_parallel.low": LOW, "data_parallel.high": LOW},
    "rank1 (high only)": {"data_parallel.low": HIGH, "data_parallel.high": HIGH},
    "accordion 2/1": {"data_parallel.low": LOW, "data_parallel.high": HIGH},
}
AXES = {"optimizer": optimizer_axis("sgdm", "adam")}
SEEDS = (0, 1)
BASELINE = "dense"
