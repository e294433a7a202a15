# Repro of the text_accordion_topk abort (needs branch text for the dataset/configs); see README.md.
import sys
from jaxcomp.main import load_config
from jaxcomp import train
c = load_config("/work/wt/text/configs/text_gpt_accordion.py")
ov = {"total_steps": int(sys.argv[1]), "eval_every": 1000, "checkpoint_every": 1000, "log_every": 1,
      "data_parallel.interval_steps": 20, "optax_name": "adam", "optax": {}, "lr": 0.003, "seed": int(sys.argv[2])}
with c.unlocked() if hasattr(c, "unlocked") else __import__("contextlib").nullcontext():
    c.data_parallel["low"] = {"name": "top_k", "fraction": 0.1}
    c.data_parallel["high"] = {"name": "top_k", "fraction": 0.1}
    c.data_parallel["interval_steps"] = 20
    for k, v in ov.items():
        if "." not in k: c[k] = v
train.train_and_evaluate(c, sys.argv[3])
