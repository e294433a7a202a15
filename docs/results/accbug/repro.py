"""Repro of the text_accordion_topk abort (README.md): the GPT's data-parallel Accordion step,
TopK 10% on both levels. Run it twice with one ``JAX_COMPILATION_CACHE_DIR`` (and
``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1``) and compare the losses; ``NODONATE=1`` turns the
step's state donation off.

python repro.py STEPS SEED WORKDIR
"""

import os
import sys

from jaxcomp import _driver
from jaxcomp import train
from jaxcomp.main import load_config

if os.environ.get("NODONATE"):
    _init = _driver.Program.__init__

    def _no_donation(self, *a, **k):
        k["donate"] = False
        _init(self, *a, **k)

    _driver.Program.__init__ = _no_donation

c = load_config("configs/text_gpt_accordion.py")
c.data_parallel["low"] = {"name": "top_k", "fraction": 0.1}
c.data_parallel["high"] = {"name": "top_k", "fraction": 0.1}
c.data_parallel["interval_steps"] = 20
c.total_steps, c.seed = int(sys.argv[1]), int(sys.argv[2])
c.eval_every, c.checkpoint_every, c.log_every = 1000, 1000, 1
c.optax_name, c.optax, c.lr = "adam", {}, 0.003
train.train_and_evaluate(c, sys.argv[3])
