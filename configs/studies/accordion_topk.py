r"""Accordion, the TopK pair: static TopK 99% (low compression only), static TopK 10% (high
compression only) and Accordion switching per layer between them, against dense data
parallelism, with SGD-momentum and Adam.

  python -m jaxcomp.study run accordion_topk --workdir runs/accordion_topk
  python -m jaxcomp.study report runs/accordion_topk

The digits MLP on 8 data-parallel fake CPU devices (``configs/digits_accordion.py``): 300 steps
(27 epochs of 11 steps), detector checked every 2 epochs, eta 0.5, error feedback on; the static
variants are Accordion with the same codec on both sides. TopK keeps the largest 99% / 10% of
each layer's gradient entries (the authors' CIFAR-10 pair). 4 variants x 2 optimizers x 2 seeds
= 16 runs.

Expected runtime: 199 s (3.3 min) measured for the whole study on 2 shared CPU cores (load
average 5.9-8.5; docs/results/accordion_topk/report.md). ``--smoke``: 16 runs of 2 steps.

Finding tested (Agarwal et al., 2021, abstract; SPEC.md sections 2.1, 2.6): Accordion reaches
the accuracy of low compression while sending close to the bytes of high compression; the
authors' CIFAR-10 ResNet-18 logs: TopK 99% 94.09%, 10% 93.08%, Accordion 93.78%.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_accordion"
COMMON = {"total_steps": 300, "eval_every": 100, "checkpoint_every": 100, "log_every": 25}
LOW = {"name": "top_k", "fraction": 0.99}
HIGH = {"name": "top_k", "fraction": 0.1}
VARIANTS = {
    "dense": {"data_parallel.transform": "compressed_mean", "data_parallel.codec": "identity"},
    "topk99 (low only)": {"data_parallel.low": LOW, "data_parallel.high": LOW},
    "topk10 (high only)": {"data_parallel.low": HIGH, "data_parallel.high": HIGH},
    "accordion 99/10": {"data_parallel.low": LOW, "data_parallel.high": HIGH},
}
AXES = {"optimizer": optimizer_axis("sgdm", "adam")}
SEEDS = (0, 1)
BASELINE = "dense"
