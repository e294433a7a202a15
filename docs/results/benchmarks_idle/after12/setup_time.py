"""Wall time of the trainer's setup() for one config (session 17's after12 measurement).

usage: python setup_time.py configs/NAME.py
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from jaxcomp.main import load_config  # noqa: E402
from jaxcomp.train import _trainer  # noqa: E402

cfg = load_config(sys.argv[1])
t = time.perf_counter()
s = _trainer.setup(cfg)
print(f"{time.perf_counter() - t:.3f}")
