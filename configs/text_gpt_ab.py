r"""AB-Training on the small GPT: 8 workers in 2 groups of 4 train the decoder's factors
independently (Coquelin et al., 2024), on Python's bundled text.

TODO

  python -m jaxcomp.main --config configs/text_gpt_ab.py --workdir runs/text_gpt_ab

Expected: TODO
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    smoke = arg == "smoke"
    base = pathlib.Path(__file__).with_name("text_gpt_dense.py")
    c = load_config(f"{base}" + (f":{arg}" if arg else ""))
    c.mode = "ab"
    c.mesh = [("group", 2), ("member", 4)]
    c.ab = dict(
        warmup_steps=1 if smoke else 60,
        sync_every=2 if smoke else 40,
        full_rank_steps=1 if smoke else 5,
        sync_mode="with-stale",
        low_rank_cutoff=0.15,
        exclude=("embed", "head"),
        inner="adam",
        max_grad_norm=1.0,
    )
    c.grad_clip_norm = None  # AB clips the averaged trained gradients itself (ab.max_grad_norm)
    return c
