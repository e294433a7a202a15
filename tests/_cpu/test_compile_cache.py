"""The persistent compilation cache is refused on XLA:CPU (``docs/results/accbug``: a cached
multi-device CPU executable trained differently from the same program compiled fresh)."""

import jax
import pytest

from jaxcomp import _cpu


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.delenv(_cpu.UNSAFE_CPU_COMPILE_CACHE, raising=False)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield str(tmp_path)
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])


def test_on_cpu_the_cache_is_turned_off_with_a_line_naming_the_reason(cache_on):
    line = _cpu.refuse_compile_cache("cpu")
    assert not jax.config.jax_enable_compilation_cache
    assert line.count("\n") == 0 and cache_on in line and "accbug" in line, line
    assert _cpu.UNSAFE_CPU_COMPILE_CACHE in line  # the way back, named


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_other_backends_keep_it(cache_on, platform):
    assert _cpu.refuse_compile_cache(platform) is None
    assert jax.config.jax_enable_compilation_cache


def test_the_unsafe_switch_keeps_it_on_cpu(cache_on, monkeypatch):
    monkeypatch.setenv(_cpu.UNSAFE_CPU_COMPILE_CACHE, "1")
    assert _cpu.refuse_compile_cache("cpu") is None
    assert jax.config.jax_enable_compilation_cache


def test_nothing_to_refuse_without_a_cache_directory(monkeypatch):
    monkeypatch.delenv(_cpu.UNSAFE_CPU_COMPILE_CACHE, raising=False)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert _cpu.refuse_compile_cache("cpu") is None
        assert jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
