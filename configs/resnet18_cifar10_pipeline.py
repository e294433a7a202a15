r"""Paper 1 (Rudakov et al., 2024): ResNet-18 on CIFAR-10 cut after layer1/2/3 into 4 pipeline
stages, TopK 5% on activations and TopK 10% on activation-gradients (per sample, independent),
the reference notebook's committed run ``fw-top5-bw-top10``.

Setup as coded by the authors: batch 128 (drop_last), random crop + flip, SGD lr 0.01 momentum
0.9 weight decay 5e-4, 100 epochs (they anneal with cosine T_max=200; we anneal over the run).
BatchNorm as the authors' model: each stage normalises every microbatch with its own statistics
and updates its running statistics microbatch by microbatch (as a PyTorch stage fed microbatches
does); with data replicas each replica keeps its own and evaluation uses replica 0's
(``pipeline.sync_batch_stats`` / ``eval_batch_stats``). ``model.norm="group"`` swaps in
GroupNorm.
Evaluation runs with boundary compression on and off (the paper's two columns).

On a host with 4 GPUs (or a TPU v4-8: 4 chips) after preparing CIFAR-10 once as array_record
(nothing downloads at run time; ``tfds build`` needs TensorFlow, in any environment):
  tfds build cifar10 --file_format=array_record --data_dir=$HOME/tensorflow_datasets
  python -m jaxcomp.main --config configs/resnet18_cifar10_pipeline.py --workdir runs/r18_pp
With 8 devices the ``data`` axis holds 2 pipeline replicas. Without the prepared dataset the run
stops with one line naming the ``tfds build`` command.

Expected: not measured here (CPU only; 39k steps). The paper's accuracy tables could not be
read (SPEC.md section 1.7); its abstract says TopK 10% is the strongest TopK that does not
severely harm convergence and that a TopK-trained model (no error feedback) needs compression
at inference too. The uncompressed reference for this ResNet-18 is about 94-95% (the
kuangliu/pytorch-cifar model; Accordion's logs: 94.5% at 300 epochs, SPEC.md section 2.6), so
expect the compression-on column a little below that and the compression-off column lower.
``:smoke`` runs a width-8 ResNet of one one-block layer, cut after its stem into 2 stages (2
microbatches), for 2 steps on a generated copy of CIFAR-10 (``data.fake``:
:func:`jaxcomp.data.write_fake_tfds`, 64 images per split; nothing is downloaded or prepared).
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 801
    c.mode = "pipeline"
    c.mesh = [("data", -1), ("stage", 4)]
    c.model_name = "resnet18"
    c.model = dict(norm="batch", cuts=("layer1", "layer2", "layer3"))
    c.data_name = "tfds_images"
    c.data = dict(name="cifar10", normalize="cifar")
    c.augment = "crop_flip"
    c.batch_size = 128
    c.eval_batch_size = 128
    c.optax_name = "sgd"
    c.optax = dict(momentum=0.9)
    c.weight_decay = 5e-4
    c.lr = 0.01
    c.schedule = "cosine"
    c.total_steps = 100 * (50_000 // 128)
    c.log_every = 100
    c.eval_every = 50_000 // 128
    c.checkpoint_every = 50_000 // 128
    c.pipeline = dict(
        num_microbatches=4,
        forward=dict(name="top_k", fraction=0.05, per_sample=True),
        backward=dict(name="top_k", fraction=0.1, per_sample=True),
    )
    if smoke:
        c.data.fake = True  # generated images: no download
        # the wiring on the least ResNet: stem | layer1 (one block) + head
        c.model = dict(norm="batch", width=8, blocks=(1,), cuts=("stem",))
        c.mesh = [("data", -1), ("stage", 2)]
        c.pipeline.num_microbatches = 2
        c.batch_size = c.eval_batch_size = 16
        c.total_steps, c.log_every, c.eval_every, c.checkpoint_every = 2, 1, 0, 0
    return c
