r"""Both axes of a 2-D mesh compressed: a 4-stage 1F1B pipeline x 2 replicas averaging by PowerSGD.

The ``digits_pipeline`` MLP (64 -> 256 -> 256 -> 256 -> 10, cut after every hidden layer) on a
``data`` 2 x ``stage`` 4 mesh of 8 (fake) devices, scheduled 1F1B (at most 4 microbatches'
activations alive per stage). Three kinds of traffic are compressed in the same step:

* activations across the stage boundaries: 4-bit codes with one scale per feature;
* activation-gradients back across them: 8-bit codes;
* the replicas' gradient average over ``data``: PowerSGD rank 2 with error feedback
  (:func:`jaxcomp.transforms.compressed_mean`; biases go dense).

  python -m jaxcomp.main --config configs/digits_pipeline_1f1b_powersgd.py --workdir runs/d2
  python -m jaxcomp.main --config configs/digits_pipeline_1f1b_powersgd.py:smoke --workdir runs/s

Expected: ~30 s of training on 2 CPU cores (28.8 s measured, 600 steps); test accuracy 97.49%
with boundary compression on and 97.77% with it off. Bytes per step and pipeline replica,
against dense float32:

* stage axis (activations + activation-gradients): 78.05 KiB instead of 384 KiB (4.9x less);
* data axis (the gradient average): 15.6 KiB (15,992 B, the step's ``data_wire_bytes``)
  instead of 589.04 KiB (``data_dense_bytes_per_step``), 36.8x less;

the compiled step's collectives total 93.70 KiB (the two axes plus 34 B of scalar loss/metric
means), where the uncompressed pipeline would send 973 KiB.
The numbers: docs/results/headline/headline.json (with the commit and jax/jaxlib versions;
``python docs/results/headline/regenerate.py --check`` reruns them).
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    c = load_config(
        f"{pathlib.Path(__file__).with_name('digits_pipeline.py')}" + (f":{arg}" if arg else "")
    )
    c.pipeline.schedule = "1f1b"
    c.pipeline.replica_mean = dict(
        transform="compressed_mean",
        codec=dict(name="power_sgd", rank=2, feedback="ef"),
    )
    return c
