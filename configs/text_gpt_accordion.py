r"""Accordion on the small GPT: 8 data-parallel workers, PowerSGD rank 4 in critical regimes and
rank 1 otherwise, switching per layer (Agarwal et al., 2021), on Python's bundled text.

The model, data and optimizer of ``text_gpt_dense`` (Adam, constant learning rate: Accordion's
detector also reads the schedule, and a decaying one marks every check critical). An epoch is
201 steps here, so the detector's interval is given in steps: gradient norms are accumulated
over 25 steps and compared every 2 intervals (the paper: intervals of one epoch, checked every
10 of 300 epochs), eta 0.5; error feedback on.

  python -m jaxcomp.main --config configs/text_gpt_accordion.py --workdir runs/text_gpt_acc

Expected: ~3 minutes on 2 shared CPU cores (600 steps, 183 s at load average 5-9); validation
perplexity ~7.8 at step 600 (10.8 at 200, 9.1 at 400; the dense ``text_gpt_dense``: 4.5,
unigram 26.1) at 58.32 KiB per worker per step on average against 917.50 KiB dense (15.7x).
(docs/results/text_exploration.md, "The configs' runs".) ``:smoke``: one block, 2 steps.
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    base = pathlib.Path(__file__).with_name("text_gpt_dense.py")
    c = load_config(f"{base}" + (f":{arg}" if arg else ""))
    c.mode = "data_parallel"
    c.data_parallel = dict(
        transform="accordion",
        low=dict(name="power_sgd", rank=4),
        high=dict(name="power_sgd", rank=1),
        interval_steps=2 if arg == "smoke" else 25,
        check_every=2,
        eta=0.5,
    )
    return c
