"""The CPU door's tune_host_malloc: freed host memory stays mapped for reuse (glibc), bad
choices are named."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from jaxcomp import _cpu
from jaxcomp._cpu import _malloc

GLIBC = platform.libc_ver()[0] == "glibc"

# One process: malloc, touch and free a 64 MiB block (over glibc's 32 MiB mmap threshold cap,
# like a large XLA:CPU temporary) 6 times; minor page faults of the last 5 rounds per round.
# The module is loaded from its file (it imports only the standard library): `from jaxcomp
# import _cpu` imported JAX, 1.5-2 s of CPU per process.
_FAULTS = textwrap.dedent(
    """
    import ctypes, importlib.util, json, resource, sys
    spec = importlib.util.spec_from_file_location("_malloc", sys.argv[2])
    _malloc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_malloc)
    result = _malloc.tune_host_malloc(sys.argv[1])
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    n = 64 << 20
    faults = []
    for _ in range(6):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps([result.applied, result.reason, sum(faults[1:]) / 5]))
    """
)


def _faults_per_round(choice):
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, choice, _malloc.__file__],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="mallopt settings are glibc's")
def test_keep_reuses_freed_large_blocks_without_page_faults():
    applied, reason, kept = _faults_per_round("keep")
    assert applied, reason
    assert "M_ARENA_MAX=1" in reason and "M_MMAP_MAX=0" in reason
    applied, _, default = _faults_per_round("default")
    assert not applied
    pages = (64 << 20) // 4096
    if default < pages / 2:
        pytest.skip(f"glibc's defaults fault only {default:.0f} of {pages} pages (huge pages?)")
    # defaults: a fresh mmap per block, every page faulted in again; kept: the heap's pages reused
    assert kept < pages / 20, (kept, default)


def test_default_changes_nothing():
    got = _cpu.tune_host_malloc("default")
    assert got == _cpu.HostMalloc(False, "choice=default: glibc's defaults kept")


@pytest.mark.parametrize("bad", ["on", "", "KEEP", None])
def test_bad_choice_is_named(bad, monkeypatch):
    if bad is None:  # the environment variable's value
        monkeypatch.setenv(_malloc.ENV, "yes")
        with pytest.raises(ValueError, match=r"\$JAXCOMP_HOST_MALLOC must be one of .*'yes'"):
            _cpu.tune_host_malloc(None)
    else:
        with pytest.raises(ValueError, match=rf"choice must be one of .*{bad!r}"):
            _cpu.tune_host_malloc(bad)


def test_environment_is_read_for_none_and_unset_means_glibc_defaults(monkeypatch):
    monkeypatch.delenv(_malloc.ENV, raising=False)
    got = _cpu.tune_host_malloc(None)
    assert got == _cpu.HostMalloc(False, "$JAXCOMP_HOST_MALLOC=default: glibc's defaults kept")
    monkeypatch.setenv(_malloc.ENV, "default")
    assert not _cpu.tune_host_malloc(None).applied


def test_not_glibc_reports_it(monkeypatch):
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("", ""))
    got = _cpu.tune_host_malloc("keep")
    assert got == _cpu.HostMalloc(False, "the C library is not glibc (unknown)")


def test_refused_setting_is_named(monkeypatch):
    class FakeLibc:
        @staticmethod
        def mallopt(param, value):
            return 0 if param == _malloc.M_MMAP_MAX else 1

    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("glibc", "2.99"))
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda name: FakeLibc())
    got = _cpu.tune_host_malloc("keep")
    assert got == _cpu.HostMalloc(False, "glibc 2.99 refused M_MMAP_MAX")


def test_main_job_takes_the_flag(monkeypatch):
    from jaxcomp import main

    monkeypatch.delenv(_malloc.ENV, raising=False)
    base = ["--config", "configs/x.py", "--workdir", "w"]
    assert main.parse_args(base).host_malloc is None  # the environment, else glibc's defaults
    assert main.parse_args([*base, "--host_malloc", "default"]).host_malloc == "default"
    with pytest.raises(SystemExit):
        main.parse_args([*base, "--host_malloc", "on"])
