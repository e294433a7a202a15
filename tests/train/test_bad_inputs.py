"""Bad input at the edge of the trainer and the CLI: one row per case, each a clear error that
names the problem."""

import ml_collections
import pytest

from jaxcomp import train


def _config():
    c = ml_collections.ConfigDict()
    c.mode = "pipeline"
    c.lr = 1e-3
    c.optax_name = "adam"
    c.batch_size = 64
    c.model = dict(hidden=(256, 256))
    c.pipeline = dict(
        forward=dict(name="quantize", bits=4, scale="feature"), backward={"name": "top_k"}
    )
    return c


# --- apply_overrides -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"lr.x": 1}, r"cannot set 'lr.x': config.lr is a number \(0.001\), not a dict"),
        ({"lr": "abc"}, r"config.lr must be a number .*got a string \('abc'\)"),
        ({"batch_size": True}, r"config.batch_size must be a number .*got a bool"),
        ({"lr": None}, r"config.lr cannot be None"),
        ({"learning_rate": 0.1}, r"unknown config key 'learning_rate'; allowed keys are"),
        ({"pipeline.fwd": "top_k"}, r"unknown config key 'pipeline.fwd'; config.pipeline takes"),
        ({"ab.sync_evry": 2}, r"unknown config key 'ab.sync_evry'"),
        ({"data_parallel.lo.rank": 2}, r"unknown config key 'data_parallel.lo'"),
        (
            {"pipeline.backward.fractoin": 0.1},
            r"unknown config key 'pipeline.backward.fractoin': codec top_k takes",
        ),
        (
            {"pipeline.forward.name": "top_k"},  # quantize's arguments do not fit top_k
            r"unknown config key 'pipeline.forward.bits': codec top_k takes",
        ),
        ({"pipeline.forward.name": "top_j"}, r"config.pipeline.forward.name: unknown codec"),
        ({"pipeline.forward.bits": "four"}, r"config.pipeline.forward.bits must be a number"),
        ({"pipeline.forward": 3}, r"config.pipeline.forward is a codec spec"),
        ({"optax_name.x": 1}, r"config.optax_name is a string \('adam'\), not a dict"),
        ({"model.hidden.x": 1}, r"config.model.hidden is a list or tuple"),
        ({"mesh.data": 8}, r"cannot set 'mesh.data': config.mesh"),
        ({"pipeline..x": 1}, r"malformed config key 'pipeline..x'"),
        (
            {"pipeline.forward.bits": 8, "pipeline.forward": "identity"},
            r"override 'pipeline.forward' replaces 'pipeline.forward.bits' given before it",
        ),
    ],
)
def test_bad_override_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match) as info:
        train.apply_overrides(_config(), overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "items, match",
    [
        (["lr"], r"--set expects KEY=VALUE .*got 'lr'"),
        (["=3"], r"--set expects KEY=VALUE"),
    ],
)
def test_bad_set_item_is_named(items, match):
    with pytest.raises(ValueError, match=match):
        train.parse_overrides(items)


def test_overrides_must_be_a_mapping():
    with pytest.raises(TypeError, match="overrides must be a mapping"):
        train.apply_overrides(_config(), ["lr=1"])
