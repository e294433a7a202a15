"""Each step program of a trainer config compiled alone: process CPU, wall and fusion kernels.

``PYTHONPATH=REPO python compile_times.py digits_ab`` (from REPO): runs ``jaxcomp.main`` for one
step with ``jaxcomp._compile.compile_all`` replaced by a serial loop that times each compile.
"""

import shutil
import sys
import time

from jaxcomp import _compile
from jaxcomp import main

config = sys.argv[1]
workdir = f"/tmp/compile_times_{config}"
shutil.rmtree(workdir, ignore_errors=True)


def timed(lowered):
    out = {}
    for name, low in lowered.items():
        cpu, wall = time.process_time(), time.perf_counter()
        out[name] = low.compile()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        fusions = out[name].as_text().count("fusion(")
        print(f"COMPILE {name:12s} cpu {cpu:6.2f} s wall {wall:6.2f} s fusions {fusions}")
    return out


_compile.compile_all = timed
sets = ["total_steps=1", "eval_every=0", "checkpoint_every=0"]
main.main(["--config", f"configs/{config}.py", "--workdir", workdir]
          + [a for s in sets for a in ("--set", s)])  # fmt: skip
