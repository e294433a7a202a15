r"""Accordion (Agarwal et al., 2021) with TopK on CIFAR-10 ResNet-18: K = 99% in critical
regimes, K = 10% otherwise (with error feedback, averaged: the reference sums without it), per
layer, η = 0.5, checked every 10 epochs; 4 workers of batch 128
(global 512), SGD momentum 0.9, weight decay 1e-4, lr 0.1 divided by 10 at epochs 150 and 250,
300 epochs. An LR drop switches every layer to low compression, as in the reference.

BatchNorm with per-worker statistics, evaluation with worker 0's, as the PowerSGD variant.

Deviations: no 5-epoch linear LR warm-up to 4x.

On a host with 4 GPUs (or a TPU v4-8), after preparing CIFAR-10 once as array_record (nothing
downloads at run time; ``tfds build`` needs TensorFlow, in any environment):
  tfds build cifar10 --file_format=array_record --data_dir=$HOME/tensorflow_datasets
  python -m jaxcomp.main --config configs/resnet18_cifar10_accordion_topk.py --workdir runs/acc_topk
Without the prepared dataset the run stops with one line naming the ``tfds build`` command.

Expected: not measured here (CPU only). The reference's logs (SPEC.md section 2.6, final epoch):
93.78% test accuracy for Accordion vs 94.09% (static 99%) and 93.08% (static 10%). TopK 99%
costs more than dense (values + indices), so its low-compression mode falls back to the exact
dense mean (``min_compression_rate``).
``:smoke`` runs a 1-layer, width-8 ResNet for 2 steps on a generated copy of
CIFAR-10 (``data.fake``: :func:`jaxcomp.data.write_fake_tfds`, 64 images per split; nothing is
downloaded or prepared).
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    c = load_config(
        f"{pathlib.Path(__file__).with_name('resnet18_cifar10_accordion_powersgd.py')}"
        + (f":{arg}" if arg else "")
    )
    c.data_parallel.low = dict(name="top_k", fraction=0.99)
    c.data_parallel.high = dict(name="top_k", fraction=0.1)
    return c
