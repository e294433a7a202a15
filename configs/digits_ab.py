r"""AB-Training on digits: 8 workers in 2 groups of 4 train the MLP's factors independently
(``with-stale`` sync every 40 steps, 5 full-rank steps after each, cutoff 0.15), after 60
full-rank warm-up steps; the first layer and the classifier stay full-rank, and the factors
are stored (and sent) at a rank capacity of 64 of 256.

  python -m jaxcomp.main --config configs/digits_ab.py --workdir runs/digits_ab

Expected: ~8 s of training on 2 idle CPU cores (8.1-8.4 s, where digits_dense with the same
300 steps took 6.1-6.4 s; 11.3 s beside a CPU-busy process, dense 8.5 s; medians of 2-5 runs,
docs/results/benchmarks_idle/after12), test accuracy 97.49%; HLO bytes per step: 589 KiB full-rank,
205 KiB in AB phases, 538 KiB at a sync; 56% less traffic than data parallelism over a full
cycle (the paper: 50-70%).
The numbers: docs/results/headline/headline.json (with the commit and jax/jaxlib versions;
``python docs/results/headline/regenerate.py --check`` reruns them).
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "ab"
    c.mesh = [("group", 2), ("member", 4)]
    c.model_name = "mlp"
    c.model = dict(hidden=(256, 256, 256))
    c.data_name = "digits"
    c.batch_size = 128
    c.eval_batch_size = 120
    c.lr = 1e-3
    c.total_steps = 2 if smoke else 300
    c.log_every = 1 if smoke else 25
    c.eval_every = 0 if smoke else 100
    c.checkpoint_every = 0 if smoke else 100
    c.ab = dict(
        warmup_steps=1 if smoke else 60,
        sync_every=2 if smoke else 40,
        full_rank_steps=1 if smoke else 5,
        sync_mode="with-stale",
        low_rank_cutoff=0.15,
        exclude=("fc1", "head"),
        max_rank_fraction=0.25,  # factors travel at a capacity of 64 of 256 columns
        inner="adam",
    )
    return c
