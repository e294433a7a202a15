r"""Uncompressed baseline for the main job: the same MLP, dense data parallelism on 8 devices.

  python -m jaxcomp.main --config configs/digits_dense.py --workdir runs/digits_dense

Expected: ~25 s on 2 CPU cores (23 s measured), test accuracy 98.33%; 589 KiB of float32
gradient all-reduce per step (the whole model), the yardstick for the compressed modes.
The numbers: docs/results/headline/headline.json (with the commit and jax/jaxlib versions;
``python docs/results/headline/regenerate.py --check`` reruns them).
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "dense"
    c.mesh = [("data", 8)]
    c.model_name = "mlp"
    c.model = dict(hidden=(256, 256, 256))
    c.data_name = "digits"
    c.batch_size = 128
    c.eval_batch_size = 120
    c.optax_name = "adam"
    c.lr = 1e-3
    c.total_steps = 2 if smoke else 600
    c.log_every = 1 if smoke else 50
    c.eval_every = 0 if smoke else 200
    c.checkpoint_every = 0 if smoke else 200
    return c
