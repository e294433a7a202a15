"""Every ``>>>`` example in the library's docstrings runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import jaxcomp

#: an example prints shapes, dtypes and values rounded to a few digits, no bit of XLA's optimised
#: program: its jitted and eager programs compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp.")
    if not m.name.endswith("__main__") and ".bench." not in m.name and m.name != "jaxcomp.main"
)


def test_the_library_has_examples():
    assert SLOW <= set(MODULES), f"SLOW names modules that do not exist: {SLOW - set(MODULES)}"
    finder = doctest.DocTestFinder()
    count = sum(
        len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name))
    )
    assert count > 100


#: the modules whose examples compile a pipeline or a factorisation, or run PowerSGD or RandK
#: eagerly (op by op: 1-2 s each; both codecs run eagerly in the fast tier's
#: tests/compressors/test_low_rank.py and test_sparse.py): the slow tier
SLOW = {"jaxcomp.models._staged", "jaxcomp.pipeline._build",
        "jaxcomp.compressors._low_rank", "jaxcomp.ab._transform",
        "jaxcomp.comm._reduce_plan", "jaxcomp.compressors._power_sgd",
        "jaxcomp.compressors._rand_k"}  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODULES]
)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
