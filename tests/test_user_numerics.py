"""The ``user_numerics`` tests, run with the XLA:CPU emitters users get.

The suite's pytest processes compile with XLA:CPU's loop emitters (``tests/conftest.py``: the
suite is compile-bound and they compile in ~25-38% less CPU). A test that pins XLA:CPU's numerics
as users see them (golden arrays, bits compared across compiles, magnitude and subnormal edges,
fused multiply-adds, non-finite patterns) is marked ``user_numerics``: the loop-emitter processes
deselect it and this test runs every one they deselected in one pytest process of their own
with the fusion emitters, so that each still runs once per suite, on the emitters users get.
By hand: ``JAXCOMP_TEST_FUSION_EMITTERS=1 pytest -m user_numerics``.
"""

import os
import re
import subprocess
import sys

import pytest


def test_user_numerics_tests_pass_with_the_fusion_emitters(request, user_numerics_deselected):
    if not user_numerics_deselected:
        pytest.skip("this run collected no user_numerics test")
    config = request.config
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["JAXCOMP_TEST_FUSION_EMITTERS"] = "1"
    args = ["-m", "user_numerics", "-q", "-p", "no:cacheprovider", "--durations=10"]
    if config.getoption("--set-mesh"):
        args.append("--set-mesh")
    if config.pluginmanager.has_plugin("suite_profile"):
        args += ["-p", "suite_profile"]  # its rows land in the same file, worker "main"
    cmd = [sys.executable, "-m", "pytest", *args, *user_numerics_deselected]
    proc = subprocess.run(
        cmd, cwd=config.rootpath, env=env, capture_output=True, text=True, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"the user_numerics tests failed with XLA:CPU's fusion emitters (rc={proc.returncode}; "
        f"rerun: JAXCOMP_TEST_FUSION_EMITTERS=1 pytest -m user_numerics):\n{out[-30000:]}"
    )
    summary = proc.stdout.strip().splitlines()[-1]  # "N passed, M skipped in T s"
    ran = sum(int(n) for n in re.findall(r"(\d+) (?:passed|skipped|xfailed|xpassed)", summary))
    assert ran == len(user_numerics_deselected), (
        f"{ran} of the {len(user_numerics_deselected)} user_numerics tests ran: {summary}"
    )
