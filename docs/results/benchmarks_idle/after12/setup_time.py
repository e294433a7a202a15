import os, time, sys
t0=time.perf_counter()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from jaxcomp.main import load_config
from jaxcomp.train import _trainer
cfg = load_config(sys.argv[1])
t=time.perf_counter(); s = _trainer.setup(cfg); print(f"{time.perf_counter()-t:.3f}")
