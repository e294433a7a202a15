r"""Accordion, the batch-size variant: small batches only (128 per update), large batches only
(8 x 128 = 1024 per update) and Accordion switching between them (small in critical regimes),
at equal epochs and the same learning rate (``lr_scaling = "none"``: the authors' logs switch the
batch with the LR schedule unchanged, SPEC.md section 2.5), with SGD-momentum and Adam;
gradients averaged uncompressed.

  python -m jaxcomp.study run accordion_batch_size --workdir runs/accordion_batch_size
  python -m jaxcomp.study report runs/accordion_batch_size

The digits MLP on 8 data-parallel fake CPU devices (``configs/digits_accordion.py`` with
``data_parallel.transform = "accordion_batch_size"``): 330 micro-batch steps of 128 (30 epochs
of 11), the detector checked every 2 epochs, eta 0.5; a large batch accumulates 8 micro-batches
and communicates once (the report's bytes per step are per micro-batch step). 3 variants x 2
optimizers x 2 seeds = 12 runs.

Expected runtime: 105 s (1.8 min) measured for the whole study on 2 shared CPU cores (load
average 8.5; docs/results/accordion_batch_size/report.md). ``--smoke``: 12 runs of 2 steps.

Finding tested (Agarwal et al., 2021, abstract; SPEC.md sections 2.1, 2.5, 2.6): the detector
also works for switching the batch size: Accordion reaches the small batch's accuracy with
close to the large batch's communication; the authors' CIFAR-10 ResNet-18 logs: batch 512
94.49%, 4096 93.21%, Accordion 94.34%.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_accordion"
COMMON = {
    "total_steps": 330,
    "eval_every": 110,
    "checkpoint_every": 110,
    "log_every": 22,
    "data_parallel.transform": "accordion_batch_size",
    "data_parallel.codec": "identity",
    "data_parallel.lr_scaling": "none",
}
VARIANTS = {
    "small only": {"data_parallel.small_steps": 1, "data_parallel.large_steps": 1},
    "large only": {"data_parallel.small_steps": 8, "data_parallel.large_steps": 8},
    "accordion 1/8": {"data_parallel.small_steps": 1, "data_parallel.large_steps": 8},
}
AXES = {"optimizer": optimizer_axis("sgdm", "adam")}
SEEDS = (0, 1)
BASELINE = "small only"
