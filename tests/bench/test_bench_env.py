"""``python -m jaxcomp.bench`` records its host allocator setting in ``env.host_malloc``."""

import json

from jaxcomp import _cpu
from jaxcomp._cpu import _malloc
from jaxcomp.bench import __main__ as bench_main

ARGS = ["compressors", "--n", "1024", "--repeats", "1", "--only", "identity"]


def _env(path):
    return json.loads(path.read_text())["env"]


def test_entry_point_records_the_allocator_setting_it_made(tmp_path, monkeypatch):
    made = _malloc.HostMalloc(True, "M_ARENA_MAX=1, (recorded as made)")
    seen = []

    def fake_tune(choice):
        seen.append(choice)
        return made

    monkeypatch.setattr(_cpu, "tune_host_malloc", fake_tune)
    path = tmp_path / "c.json"
    assert bench_main.main([*ARGS, "--json", str(path)]) == 0
    assert seen == [None]  # the environment decides, as for the main job
    assert _env(path)["host_malloc"] == made.reason


def test_entry_point_with_glibc_defaults_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(_malloc.ENV, "default")
    path = tmp_path / "c.json"
    assert bench_main.main([*ARGS, "--json", str(path)]) == 0
    assert _env(path)["host_malloc"] == "$JAXCOMP_HOST_MALLOC=default: glibc's defaults kept"


def test_in_process_call_says_it_did_not_set_it(tmp_path):
    from jaxcomp.bench import compressors

    path = tmp_path / "c.json"
    assert compressors.main([*ARGS[1:], "--json", str(path)]) == 0
    assert _env(path)["host_malloc"] == "not set (run through python -m jaxcomp.bench)"


def test_bad_environment_value_is_an_error_before_any_benchmark_runs(monkeypatch, capsys):
    monkeypatch.setenv(_malloc.ENV, "always")
    assert bench_main.main(ARGS) == 2
    assert "JAXCOMP_HOST_MALLOC must be one of" in capsys.readouterr().err
