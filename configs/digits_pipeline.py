r"""The main job: handwritten digits through a 4-stage compressed pipeline on 8 (fake) devices.

An MLP (64 -> 256 -> 256 -> 256 -> 10) is cut after every hidden layer into 4 stages on the
``stage`` mesh axis, with 2 data-parallel pipeline replicas (``data`` axis) filling 8 devices.
Every boundary sends its activations as 4-bit codes with one fp16 scale per feature (AC-SGD's
quantizer) and its activation-gradients as 8-bit codes, as Rudakov et al. find gradients more
sensitive than activations. Evaluation reports accuracy with boundary compression on and off.

  python -m jaxcomp.main --config configs/digits_pipeline.py --workdir runs/digits
  python -m jaxcomp.main --config configs/digits_pipeline.py:smoke --workdir runs/smoke

Expected: ~1 min on 2 CPU cores (58 s measured from a fresh virtualenv, 600 steps); test
accuracy 97.77% with boundary compression on and 98.33% with it off; boundary traffic 4.9x
smaller than dense float32 (78 KiB instead of 384 KiB per step and pipeline replica).
``:smoke``: 2 steps of a 64-unit MLP cut after its hidden layer into 2 stages.
The uncompressed baseline:
  python -m jaxcomp.main --config configs/digits_pipeline.py --workdir runs/digits_id \
      --set 'pipeline.forward="identity"' --set 'pipeline.backward="identity"'
The numbers: docs/results/headline/headline.json (with the commit and jax/jaxlib versions;
``python docs/results/headline/regenerate.py --check`` reruns them).
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "pipeline"
    c.mesh = [("data", 2), ("stage", 4)]
    c.model_name = "mlp"
    c.model = dict(hidden=(256, 256, 256))
    c.data_name = "digits"
    c.data = dict(flat=True)
    c.batch_size = 128
    c.eval_batch_size = 128
    c.optax_name = "adam"
    c.lr = 1e-3
    c.total_steps = 2 if smoke else 600
    c.log_every = 1 if smoke else 25
    c.eval_every = 0 if smoke else 100
    c.checkpoint_every = 0 if smoke else 200
    c.pipeline = dict(
        num_microbatches=4,
        forward=dict(name="quantize", bits=4, scale="feature"),
        backward=dict(name="quantize", bits=8),
    )
    if smoke:  # the wiring on 2 stages of 2 microbatches, one hidden layer (64) each side of
        # the cut: the programs compile in a fraction of the 4-stage ones' time
        c.mesh = [("data", 4), ("stage", 2)]
        c.model = dict(hidden=(64,), cuts=("fc1",))
        c.pipeline.num_microbatches = 2
    return c
