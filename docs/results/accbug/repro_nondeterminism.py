import os, sys
from jaxcomp import _driver
if os.environ.get("NODONATE"):
    orig = _driver.Program.__init__
    def init(self, *a, **k):
        k["donate"] = False
        orig(self, *a, **k)
    _driver.Program.__init__ = init
from jaxcomp import train
from jaxcomp.main import load_config
c = load_config("configs/text_gpt_accordion.py")
c.data_parallel["low"] = {"name": "top_k", "fraction": 0.1}
c.data_parallel["high"] = {"name": "top_k", "fraction": 0.1}
c.data_parallel["interval_steps"] = 20
c.total_steps, c.seed = int(sys.argv[1]), int(sys.argv[2])
c.eval_every, c.checkpoint_every, c.log_every = 1000, 1000, 1
c.optax_name, c.optax, c.lr = "adam", {}, 0.003
train.train_and_evaluate(c, sys.argv[3])
