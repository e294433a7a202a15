"""jaxcomp._validate: every check accepts what it documents and names the parameter otherwise."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import _validate as v

GOOD = [
    ("int", lambda: v.check_int("n", 3, 1), 3),
    ("int_numpy", lambda: v.check_int("n", np.int64(3), 1, 3), 3),
    ("int_optional_none", lambda: v.check_int("n", None, 1, optional=True), None),
    ("number_int", lambda: v.check_number("x", 2, gt=0), 2.0),
    ("number_numpy", lambda: v.check_number("x", np.float32(0.5), ge=0, le=1), 0.5),
    ("number_0d_array", lambda: v.check_number("x", jnp.asarray(3.0), gt=0), 3.0),
    ("number_inf_unbounded", lambda: v.check_number("x", math.inf, ge=0), math.inf),
    ("number_optional_none", lambda: v.check_number("x", None, gt=0, optional=True), None),
    ("fraction_one", lambda: v.check_fraction("f", 1), 1.0),
    ("choice", lambda: v.check_choice("mode", "a", ("a", "b")), "a"),
    ("bool", lambda: v.check_bool("flag", np.bool_(True)), True),
    ("static_int", lambda: v.static_int("k", 2, 0), 2),
    ("static_number", lambda: v.static_number("r", 2.5, 0), 2.5),
    ("axis_none", lambda: v.check_axis_name(None), None),
    ("axis_str", lambda: v.check_axis_name("data"), "data"),
]


@pytest.mark.parametrize("fn,want", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_accepts(fn, want):
    got = fn()
    assert got == want and type(got) is type(want)


BAD = [
    ("int_float", lambda: v.check_int("n", 2.0, 1), r"^n must be an integer >= 1; got 2.0\.$"),
    ("int_bool", lambda: v.check_int("n", True, 0), r"n must be an integer >= 0; got True"),
    ("int_high", lambda: v.check_int("bits", 9, 1, 8), r"bits must be an integer >= 1 and <= 8"),
    ("int_str", lambda: v.check_int("n", "3"), r"^n must be an integer; got '3'\.$"),
    (
        "int_optional",
        lambda: v.check_int("max_rank", 0, 1, optional=True),
        r"max_rank must be None or an integer >= 1; got 0",
    ),
    ("number_nan", lambda: v.check_number("eta", math.nan, gt=0), r"eta must be a number > 0"),
    ("number_bool", lambda: v.check_number("eta", True, gt=0), r"got True"),
    ("number_str", lambda: v.check_number("lr", "0.1", ge=0), r"lr must be a number >= 0"),
    (
        "number_inf_finite",
        lambda: v.check_number("t", math.inf, ge=0, finite=True),
        r"t must be a finite number >= 0; got inf",
    ),
    (
        "number_open_interval",
        lambda: v.check_number("q", 1.0, gt=0, lt=1),
        r"q must be a number > 0 and < 1; got 1.0",
    ),
    ("number_vector", lambda: v.check_number("x", np.ones(2), gt=0), r"x must be a number > 0"),
    (
        "number_traced",
        lambda: jax.jit(lambda a: v.check_number("x", a, gt=0))(1.0),
        r"x must be a number > 0; got .*Tracer",
    ),
    ("fraction_zero", lambda: v.check_fraction("f", 0.0), r"f must be a fraction in \(0, 1\]"),
    ("fraction_nan", lambda: v.check_fraction("f", math.nan), r"f must be a fraction"),
    (
        "choice",
        lambda: v.check_choice("mode", "c", ("a", "b")),
        r"mode must be one of \('a', 'b'\)",
    ),
    ("choice_unhashable", lambda: v.check_choice("m", [1], {"a"}), r"m must be one of"),
    ("bool_int", lambda: v.check_bool("flag", 1), r"flag must be a bool; got 1"),
    (
        "static_int_array",
        lambda: v.static_int("seed", jnp.asarray(1), 0),
        r"seed must be a Python int >= 0.*static_args=\('seed',\)",
    ),
    (
        "static_number_array",
        lambda: v.static_number("rate", np.asarray(2.0), 0),
        r"rate must be a Python number >= 0.*static_args",
    ),
    ("static_int_float", lambda: v.static_int("seed", 1.5, 0), r"seed must be an integer >= 0"),
    ("axis_int", lambda: v.check_axis_name(0), r"axis_name must be a mesh axis name \(str\)"),
    (
        "tree",
        lambda: v.check_tree({"a": 1, "b": 2}, {"a": 0}, "who"),
        r"who: the updates tree does not match",
    ),
    (
        "state_leaves",
        lambda: v.check_state_leaves(
            (jnp.zeros((2, 3)),),
            (jax.ShapeDtypeStruct((2, 4), jnp.float32),),
            "['w']",
            jnp.zeros((2, 4)),
            "who",
        ),
        r"who: the state of parameter \['w'\] was not built for float32\[2,4\]",
    ),
]


@pytest.mark.parametrize("fn,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_rejects_with_a_named_error(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_describe():
    assert v.describe(jax.ShapeDtypeStruct((8, 6), jnp.bfloat16)) == "bfloat16[8,6]"
    assert v.describe(np.zeros((), np.int32)) == "int32[]"
