r"""Accordion (Agarwal et al., 2021) with PowerSGD on CIFAR-10 ResNet-18: rank 2 in critical
regimes, rank 1 otherwise, per layer, η = 0.5, checked every 10 epochs; 4 workers of batch 128
(global 512), SGD momentum 0.9, weight decay 1e-4, lr 0.1 divided by 10 at epochs 150 and 250,
300 epochs. An LR drop switches every layer to low compression, as in the reference.

BatchNorm as in the reference, with per-worker running statistics (the reference all-reduces
parameter gradients only) and evaluation with worker 0's (the reference's logs are rank 0's);
``data_parallel.sync_batch_stats=True`` synchronises them (SyncBatchNorm) and
``model.norm="group"`` swaps in GroupNorm.

Deviations: no 5-epoch linear LR warm-up to 4x; running variances are the biased batch
variances (PyTorch keeps the unbiased ones, a factor n/(n-1) apart).

On a host with 4 GPUs (or a TPU v4-8), after preparing CIFAR-10 once as array_record (nothing
downloads at run time; ``tfds build`` needs TensorFlow, in any environment):
  tfds build cifar10 --file_format=array_record --data_dir=$HOME/tensorflow_datasets
  python -m jaxcomp.main --config configs/resnet18_cifar10_accordion_powersgd.py \
      --workdir runs/acc_psgd
Without the prepared dataset the run stops with one line naming the ``tfds build`` command.

Expected: not measured here (CPU only). The reference's logs (SPEC.md section 2.6, final epoch):
94.72% test accuracy for Accordion vs 94.49% (static rank 2) and 94.25% (static rank 1), with
~136x (rank 2) / ~243x (rank 1) fewer floats than dense; the paper reports up to 5.5x less
communication than static low compression at similar accuracy.
``:smoke`` runs a 1-layer, width-8 ResNet for 2 steps on a generated copy of
CIFAR-10 (``data.fake``: :func:`jaxcomp.data.write_fake_tfds`, 64 images per split; nothing is
downloaded or prepared).
"""

import ml_collections

STEPS_PER_EPOCH = 50_000 // 512


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 42
    c.mode = "data_parallel"
    c.mesh = [("data", 4)]
    c.model_name = "resnet18"
    c.model = dict(norm="batch", cuts=())
    c.data_name = "tfds_images"
    c.data = dict(name="cifar10", normalize="cifar")
    c.augment = "crop_flip"
    c.batch_size = 512
    c.eval_batch_size = 500
    c.optax_name = "sgd"
    c.optax = dict(momentum=0.9)
    c.weight_decay = 1e-4
    c.lr = 0.1
    c.schedule = "step"
    c.lr_decay_steps = [150 * STEPS_PER_EPOCH, 250 * STEPS_PER_EPOCH]
    c.total_steps = 300 * STEPS_PER_EPOCH
    c.log_every = 50
    c.eval_every = STEPS_PER_EPOCH
    c.checkpoint_every = 5 * STEPS_PER_EPOCH
    c.data_parallel = dict(
        transform="accordion",
        low=dict(name="power_sgd", rank=2),
        high=dict(name="power_sgd", rank=1),
        interval_epochs=1,
        check_every=10,
        eta=0.5,
        sync_batch_stats=False,
        eval_batch_stats="worker0",
    )
    if smoke:
        c.data.fake = True  # generated images: no download
        c.model = dict(norm="batch", cuts=(), width=8, blocks=(1,))  # a 1-layer ResNet
        c.batch_size = c.eval_batch_size = 16
        c.lr_decay_steps = [1]
        c.total_steps, c.log_every, c.eval_every, c.checkpoint_every = 2, 1, 0, 0
    return c
