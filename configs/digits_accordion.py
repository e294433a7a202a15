r"""Accordion on digits: 8 data-parallel workers, PowerSGD rank 2 in critical regimes, rank 1
otherwise, switching per layer (Agarwal et al., 2021), momentum SGD.

An "interval" (the paper's epoch) is one pass over the 1,438 training digits (11 steps), checked
every 2 intervals (the paper: every 10 epochs of 300).

  python -m jaxcomp.main --config configs/digits_accordion.py --workdir runs/digits_accordion

Expected: ~30 s on 2 CPU cores (30 s measured), test accuracy 98.05%; 10.8 KiB of PowerSGD
factors per step on average instead of 589 KiB dense (54.5x), more in the critical intervals.
The numbers: docs/results/headline/headline.json (with the commit and jax/jaxlib versions;
``python docs/results/headline/regenerate.py --check`` reruns them).

On several hosts, name the slow axis: ``--set 'mesh=[("slow", HOSTS), ("fast", DEVICES)]'``
averages densely inside each host and compresses only between hosts, in fewer and smaller
rings across the slow links: faster there (docs/results/network/README.md, the hierarchical
mesh). PowerSGD's results do not change with it (error feedback and shared factors keep it
linear in the gradients).
``:smoke``: a one-hidden-layer MLP (32 units) for 2 steps.
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "data_parallel"
    c.mesh = [("data", 8)]
    c.model_name = "mlp"
    c.model = dict(hidden=(256, 256, 256))
    c.data_name = "digits"
    c.batch_size = 128
    c.eval_batch_size = 120
    c.optax_name = "sgd"
    c.optax = dict(momentum=0.9)
    c.lr = 0.05
    c.total_steps = 2 if smoke else 300
    c.log_every = 1 if smoke else 25
    c.eval_every = 0 if smoke else 100
    c.checkpoint_every = 0 if smoke else 100
    c.data_parallel = dict(
        transform="accordion",
        low=dict(name="power_sgd", rank=2),
        high=dict(name="power_sgd", rank=1),
        interval_epochs=1,
        check_every=2,
        eta=0.5,
    )
    if smoke:  # the wiring on one hidden layer: two compressed kernels (each compiles its codecs)
        c.model.hidden = (32,)
    return c
