"""The garbage collector's thresholds of ``tests/conftest.py`` for the Python processes the suite
starts (CLI runs, process pairs, the lab's hosts, notebook kernels, the user-numerics runner):
the conftest puts this folder first on their ``PYTHONPATH`` and Python imports ``sitecustomize``
at startup. A JAX child's CPU is mostly tracing and compiling; at the default thresholds the
collector walks the heap its imports left thousands of times (docs/results/suite_tiers, suite15
lead). Only when the collector runs changes, not what it frees."""

import gc

gc.set_threshold(100_000, 50, 1000)
