"""_compile.compile_all: the executables a serial compile gives, errors named by program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import _compile


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
