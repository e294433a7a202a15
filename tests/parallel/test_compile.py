"""_compile.compile_all: the executables a serial compile gives, errors named by program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import _compile
from jaxcomp import _cpu


def _lowered():
    f = jax.jit(lambda x, y: jnp.tanh(x @ y).sum(0))
    g = jax.jit(lambda x: jnp.cumsum(x * 3.0))
    x = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
    return {"f": f.lower(x, x), "g": g.lower(x[0])}, x


def test_the_same_executables_as_one_by_one_and_the_same_bits():
    lowered, x = _lowered()
    together = _compile.compile_all(lowered)
    assert list(together) == ["f", "g"]
    for name, low in lowered.items():
        assert together[name].as_text() == low.compile().as_text(), name
    want = jax.jit(lambda x, y: jnp.tanh(x @ y).sum(0))(x, x)
    assert np.asarray(together["f"](x, x)).tobytes() == np.asarray(want).tobytes()
    assert _compile.compile_all({}) == {}
    assert list(_compile.compile_all({"g": lowered["g"]})) == ["g"]  # one: no thread


def test_a_failing_compile_raises_its_own_error_naming_the_program():
    class Broken:
        def compile(self):
            raise RuntimeError("XLA says no")

    lowered, _ = _lowered()
    with pytest.raises(RuntimeError, match="XLA says no") as info:
        _compile.compile_all({"f": lowered["f"], "refactor": Broken(), "g": lowered["g"]})
    assert any("'refactor'" in note for note in info.value.__notes__)


def test_every_failure_is_named():
    class Broken:
        def __init__(self, why):
            self.why = why

        def compile(self):
            raise RuntimeError(self.why)

    lowered, _ = _lowered()
    with pytest.raises(RuntimeError, match="first") as info:
        _compile.compile_all({"a": Broken("first"), "f": lowered["f"], "b": Broken("second")})
    assert info.value.__notes__ == [
        "(while compiling the program 'a')",
        "(the compilation of ['b'] failed too)",
    ]


def test_the_callers_with_block_config_reaches_the_compiling_threads(monkeypatch):
    """JAX reads compile options from its configuration when a program compiles, and a value
    set in a ``with`` block is local to the caller's thread: without re-entering it there, a
    worker thread compiled with the global value (exec_time_optimization_effort 0.0, not -0.5:
    a different executable than the caller's own ``lowered.compile()``)."""
    from jax._src import compiler
    from jax._src import config as jax_config  # private: compile_all reads its config_states

    seen = []
    real = compiler.get_compile_options

    def spy(*args, **kwargs):
        options = real(*args, **kwargs)
        seen.append(options.executable_build_options.exec_time_optimization_effort)
        return options

    monkeypatch.setattr(compiler, "get_compile_options", spy)
    f = jax.jit(lambda x: jnp.sin(x) * 2.5)
    g = jax.jit(lambda x: jnp.cos(x) - 1.5)
    x = np.arange(5, dtype=np.float32)
    with jax_config.exec_time_optimization_effort(-0.5):
        _compile.compile_all({"f": f.lower(x), "g": g.lower(x)})
    assert seen == [-0.5, -0.5]
    assert jax_config.exec_time_optimization_effort.get_local() is jax_config.config_ext.unset


def test_programs_given_as_functions_are_lowered_in_order_and_compiled_the_same():
    lowered, x = _lowered()
    order = []

    def lazily(name):
        def lower():
            order.append(name)
            return lowered[name]

        return lower

    together = _compile.compile_all({"f": lazily("f"), "g": lazily("g"), "f2": lowered["f"]})
    assert order == ["f", "g"] and list(together) == ["f", "g", "f2"]
    for name in ("f", "g"):
        assert together[name].as_text() == lowered[name].compile().as_text(), name
    assert list(_compile.compile_all({"g": lazily("g")})) == ["g"]  # one: no thread


def test_a_program_that_fails_to_lower_is_named_and_the_later_ones_are_not_lowered():
    lowered, _ = _lowered()
    reached = []

    def broken():
        raise TypeError("cannot trace this")

    def later():
        reached.append("h")
        return lowered["g"]

    with pytest.raises(TypeError, match="cannot trace this") as info:
        _compile.compile_all({"f": lowered["f"], "refactor": broken, "h": later})
    assert info.value.__notes__ == ["(while lowering the program 'refactor')"]
    assert reached == []


def test_with_options_compiles_with_them_every_time(monkeypatch):
    seen = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None):
        seen.append(compiler_options)
        return real(self, compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    x = np.arange(4, dtype=np.float32)
    low = _compile.WithOptions(jax.jit(lambda v: v * 2.0).lower(x), _cpu.RARELY_RUN_OPTIONS)
    assert "func.func" in low.as_text()  # the lowered program's own attributes
    out = _compile.compile_all({"a": low, "b": lambda: low})
    assert seen == [_cpu.RARELY_RUN_OPTIONS] * 2
    np.testing.assert_array_equal(out["a"](x), x * 2.0)


def test_lower_later_lowers_in_the_given_mesh_only_when_reached():
    from jax.sharding import PartitionSpec as P

    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("x",), axis_types=auto, devices=jax.devices()[:2])
    f = jax.jit(lambda v: jax.lax.with_sharding_constraint(v * 2.0, P("x")))
    x = np.arange(4, dtype=np.float32)
    out = _compile.compile_all({"f": _compile.lower_later(f, x, mesh=mesh)})
    np.testing.assert_array_equal(out["f"](x), x * 2.0)
    with pytest.raises(Exception) as info:  # a bare PartitionSpec needs the mesh
        _compile.compile_all({"f": _compile.lower_later(f, x)})
    assert "(while lowering the program 'f')" in info.value.__notes__
