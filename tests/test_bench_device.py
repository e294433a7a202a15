"""``python -m jaxcomp.bench device``: on a CPU-only machine it says so and exits 0."""

import subprocess
import sys

from jaxcomp.bench import device


def test_without_an_accelerator_it_says_so_and_exits_0(capsys):
    assert device.accelerators() == []  # the suite runs on fake CPU devices
    assert device.main([]) == 0
    out = capsys.readouterr().out
    assert "no accelerator" in out and "--tiny" in out


def test_unknown_parts_are_a_usage_error():
    run = subprocess.run(
        [sys.executable, "-m", "jaxcomp.bench", "device", "--only", "compressors,nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "unknown part(s) ['nope']" in run.stderr, run.stderr
