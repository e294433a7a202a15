"""A CLI whose reader goes away (``... | head``) stops quietly, as Unix tools do."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "argv",
    [
        ("jaxcomp.study", "list"),
        pytest.param(("jaxcomp.bench", "--help"), marks=pytest.mark.slow),
    ],
)
def test_a_closed_pipe_ends_the_cli_with_141_and_no_traceback(argv):
    path = os.pathsep.join([ROOT, os.environ["PYTHONPATH"]])
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write fails, no race
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *argv], stdout=write, stderr=subprocess.PIPE, env=env,
            cwd=ROOT, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == 128 + 13, err  # as a process that SIGPIPE ended
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
