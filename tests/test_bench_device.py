"""``python -m jaxcomp.bench device``: on a CPU-only machine it says so and exits 0."""

import pytest

from jaxcomp.bench import __main__ as bench_main
from jaxcomp.bench import device


def test_without_an_accelerator_it_says_so_and_exits_0(capsys):
    assert device.accelerators() == []  # the suite runs on fake CPU devices
    assert device.main([]) == 0
    out = capsys.readouterr().out
    assert "no accelerator" in out and "--tiny" in out


def test_unknown_parts_are_a_usage_error(capsys, monkeypatch):
    """Through the entry point's dispatch, in process (a JAX child costs ~2 s of CPU to import;
    ``python -m jaxcomp.bench`` itself is launched by tests/test_broken_pipe.py)."""
    monkeypatch.setenv("JAXCOMP_HOST_MALLOC", "default")  # glibc's defaults: nothing changed
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["device", "--only", "compressors,nope"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unknown part(s) ['nope']" in err, err
