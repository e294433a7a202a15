r"""AB-Training (Coquelin et al., 2024) on CIFAR-10 VGG-16, as the reference's
``configs/cifar10/vgg16/ab_2nodes``: 8 workers in 2 groups of 4 (the reference: group size 4),
``only-b`` sync (every group trains B; A = U stays fixed), warm-up 4330 steps, a sync every 759
steps followed by 60 full-rank steps, LR rebound over 267 steps, singular-value cutoff 0.15,
AdamW 3e-3 with weight decay 0.1 and cosine decay, gradient clipping at 1.0. The first conv and
the classifier stay full-rank. Factors are stored and sent at a rank capacity of a quarter of
full rank (``max_rank_fraction=0.25``), so the truncation shows on the wire.

On a host with 8 GPUs (or a TPU v4-16 / v5e-8: 8 chips), after preparing CIFAR-10 once as
array_record (nothing downloads at run time; ``tfds build`` needs TensorFlow, in any environment):
  tfds build cifar10 --file_format=array_record --data_dir=$HOME/tensorflow_datasets
  python -m jaxcomp.main --config configs/vgg16_cifar10_ab.py --workdir runs/vgg_ab
Without the prepared dataset the run stops with one line naming the ``tfds build`` command.

Expected: not measured here (CPU only). The paper reports a 44.14:1 parameter compression
during training on this setup "while maintaining competitive accuracy" (its accuracy table
could not be read, SPEC.md section 3.1; for scale, a data-parallel VGG-16 commonly reaches
about 92-93% on CIFAR-10, a figure from the wider literature, not from this paper), and 50-70%
less network traffic than data parallelism.
``:smoke`` runs a 1/16-width VGG-16 for 2 steps (one warm-up step, one AB step) on a generated
copy of CIFAR-10 (``data.fake``: :func:`jaxcomp.data.write_fake_tfds`, 64 images per split;
nothing is downloaded or prepared).
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "ab"
    c.mesh = [("group", 2), ("member", 4)]
    c.model_name = "vgg16"
    c.model = dict()
    c.data_name = "tfds_images"
    c.data = dict(name="cifar10", normalize="cifar")
    c.augment = "crop_flip"
    c.batch_size = 512
    c.eval_batch_size = 500
    c.lr = 3e-3
    c.schedule = "warmup_cosine"
    c.warmup_steps = 10 * (50_000 // 512)
    c.weight_decay = 0.1
    c.total_steps = 300 * (50_000 // 512)
    c.log_every = 50
    c.eval_every = 50_000 // 512
    c.checkpoint_every = 5 * (50_000 // 512)
    c.ab = dict(
        warmup_steps=4330,
        sync_every=759,
        full_rank_steps=60,
        sync_mode="only-b",
        low_rank_cutoff=0.15,
        exclude=("block1/conv1", "head/fc"),
        max_rank_fraction=0.25,
        lr_rebound_steps=267,
        max_grad_norm=1.0,
        inner="adamw",
    )
    if smoke:
        c.data.fake = True  # generated images: no download
        c.model = dict(width_divisor=16)
        c.augment = None
        c.batch_size = c.eval_batch_size = 16
        c.warmup_steps = 1
        c.ab = dict(
            c.ab.to_dict(), warmup_steps=1, sync_every=2, full_rank_steps=1, lr_rebound_steps=0
        )
        c.total_steps, c.log_every, c.eval_every, c.checkpoint_every = 2, 1, 0, 0
    return c
