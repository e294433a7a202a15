"""The suite's own setup (``tests/conftest.py``): what it hands its child processes and the order
it hands tests to pytest-xdist's workers."""

import gc
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.fixture
def conftest(request):
    """The root ``tests/conftest.py`` as pytest loaded it (not importable in importlib mode)."""
    (module,) = [
        plugin
        for plugin in request.config.pluginmanager.get_plugins()
        if pathlib.Path(getattr(plugin, "__file__", "") or "")
        == pathlib.Path(__file__).with_name("conftest.py")
    ]
    return module


def test_child_processes_collect_garbage_as_rarely_as_the_test_processes():
    # the environment the tests pass on (with or without their own PYTHONPATH in front)
    for path in (
        os.environ["PYTHONPATH"],
        os.pathsep.join(["/elsewhere", os.environ["PYTHONPATH"]]),
    ):
        out = subprocess.run(
            [sys.executable, "-c", "import gc; print(gc.get_threshold())"],
            env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert out.strip() == str(gc.get_threshold()) == "(100000, 50, 1000)"


def test_the_processes_of_the_run_read_compiled_bytecode():
    import jax

    assert not sys.dont_write_bytecode
    assert pathlib.Path(importlib.util.cache_from_source(jax.__file__)).exists()
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.dont_write_bytecode, sys.pycache_prefix)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["False", str(sys.pycache_prefix)]


def test_modules_are_handed_out_longest_first_each_together(request, conftest):
    seconds = json.loads(conftest.DURATIONS.read_text())
    root = pathlib.Path(request.config.rootpath)
    gone = [m for m in seconds if not (root / m).exists()]
    assert not gone, f"tests/durations.json names modules that are gone: {gone}"
    modules = [item.nodeid.split("::")[0] for item in request.session.items]
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(runs) == len(set(runs)), "a module's tests are not together"
    unlisted = [m for m in runs if m not in seconds]
    assert seconds and len(unlisted) <= max(2, 0.1 * len(runs)), (
        f"tests/durations.json misses {len(unlisted)} of the {len(runs)} modules run (write it "
        f"again from a profile: CONTRIBUTING.md, Tests): {unlisted[:5]}"
    )
    slow = {
        item.nodeid.split("::")[0]
        for item in request.session.items
        if item.get_closest_marker("slow")
    }
    order = [
        seconds.get(m, conftest.UNLISTED_SLOW_S if m in slow else 0.0)
        for m in runs
        if not m + "::" == conftest.USER_NUMERICS_RUNNER
    ]
    assert order == sorted(order, reverse=True)
