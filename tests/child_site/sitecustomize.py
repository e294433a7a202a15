"""The garbage collector's thresholds of ``tests/conftest.py`` for the Python processes the suite
starts (CLI runs, process pairs, the lab's hosts, notebook kernels, the user-numerics runner):
the conftest puts this folder first on their ``PYTHONPATH`` and Python imports ``sitecustomize``
at startup. A JAX child's CPU is mostly tracing and compiling; at the default thresholds the
collector walks the heap its imports left thousands of times (docs/results/suite_tiers, suite15
lead). Only when the collector runs changes, not what it frees."""

import gc
import importlib.machinery
import importlib.util
import os
import sys

gc.set_threshold(100_000, 50, 1000)

# the sitecustomize this one hides (a system Python's, a coverage setup's), if any, runs too
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
