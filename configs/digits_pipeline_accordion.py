r"""Accordion on pipeline links: each boundary picks 8-bit or 4-bit codes by its own norms.

The ``digits_pipeline`` MLP (64 -> 256 -> 256 -> 256 -> 10, cut after every hidden layer) on a
``data`` 2 x ``stage`` 4 mesh of 8 (fake) devices. Every boundary is a
:func:`jaxcomp.pipeline.adaptive_link`: its activations travel as 8-bit codes with one scale per
feature in critical regimes and as 4-bit codes otherwise, and its activation-gradients as 8-bit
or 4-bit codes, each direction switched by Accordion's detector (Agarwal et al., 2021) on the
norms of what it sends: an interval is one epoch (11 steps), checked every 2 intervals with
eta = 0.5; the first interval is critical.

  python -m jaxcomp.main --config configs/digits_pipeline_accordion.py --workdir runs/dpa
  python -m jaxcomp.main --config configs/digits_pipeline_accordion.py:smoke --workdir runs/s

Expected: ~35 s on 2 CPU cores (33.4 s measured, 600 steps, one seed; the fixed links take
21-23 s: the adaptive run compiles one program per mode combination it meets). Test accuracy
with boundary compression on / off at evaluation, and boundary bytes per step (dense 393,216):

  adaptive 8/8 <-> 4/4   97.8% / 98.3%   60,150 B (mean over the run)
  fixed 8-bit (low)      98.3% / 98.3%   104,496 B
  fixed 4-bit (high)     97.8% / 98.1%   55,344 B

The train metrics log each boundary's mode per step (``link_mode_forward_<b>`` /
``link_mode_backward_<b>``, 0 = 8-bit, 1 = 4-bit).
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    c = load_config(
        f"{pathlib.Path(__file__).with_name('digits_pipeline.py')}" + (f":{arg}" if arg else "")
    )
    c.pipeline.forward = dict(name="quantize", bits=8, scale="feature")
    c.pipeline.forward_high = dict(name="quantize", bits=4, scale="feature")
    c.pipeline.backward = dict(name="quantize", bits=8)
    c.pipeline.backward_high = dict(name="quantize", bits=4)
    c.pipeline.detector = dict(interval_epochs=1, check_every=2, eta=0.5)
    return c
