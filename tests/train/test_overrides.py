"""``apply_overrides``: dotted keys set Python values; the CLI's ``--set`` goes through it."""

import ml_collections
import pytest

from jaxcomp import train


def _config():
    c = ml_collections.ConfigDict()
    c.mode = "pipeline"
    c.lr = 1e-3
    c.model = dict(hidden=(256, 256))
    c.pipeline = dict(
        num_microbatches=4,
        forward=dict(name="quantize", bits=4, scale="feature"),
        backward="identity",
    )
    return c


def test_dotted_keys_set_values_and_leave_the_input_unchanged():
    config = _config()
    before = config.to_dict()
    out = train.apply_overrides(
        config,
        {"lr": 0.05, "pipeline.forward.bits": 8, "model.hidden": (64, 64), "optax_name": "adam"},
    )
    assert isinstance(out, ml_collections.ConfigDict)
    assert out.lr == 0.05 and out.optax_name == "adam" and tuple(out.model.hidden) == (64, 64)
    assert out.pipeline.forward.to_dict() == {"name": "quantize", "bits": 8, "scale": "feature"}
    assert config.to_dict() == before


def test_a_bare_codec_name_becomes_a_spec_dict():
    out = train.apply_overrides(
        _config(), {"pipeline.backward": "top_k", "pipeline.backward.fraction": 0.05}
    )
    assert out.pipeline.backward.to_dict() == {"name": "top_k", "fraction": 0.05}
    # descending into a bare name keeps it as the spec's name
    c = _config()
    c.pipeline.backward = "top_k"
    out = train.apply_overrides(c, {"pipeline.backward.fraction": 0.1})
    assert out.pipeline.backward.to_dict() == {"name": "top_k", "fraction": 0.1}


def test_missing_sections_start_from_their_defaults():
    c = ml_collections.ConfigDict({"mode": "data_parallel"})
    out = train.apply_overrides(c, {"data_parallel.low.rank": 4, "ab.sync_every": 8})
    assert out.data_parallel.low.to_dict() == {"name": "power_sgd", "rank": 4}
    assert out.ab.to_dict() == {"sync_every": 8}
    c = ml_collections.ConfigDict({"mode": "pipeline"})
    out = train.apply_overrides(c, {"pipeline.forward.name": "top_k"})
    assert out.pipeline.forward.to_dict() == {"name": "top_k"}


def test_a_whole_spec_replaces_the_old_one():
    out = train.apply_overrides(_config(), {"pipeline.forward": "identity"})
    assert out.pipeline.forward == "identity"
    spec = {"name": "top_k", "fraction": 0.1, "feedback": "ef"}
    out = train.apply_overrides(_config(), {"pipeline.forward": spec})
    assert out.pipeline.forward.to_dict() == spec


def test_presets_are_plain_override_dicts():
    presets = {
        "forward-only": {"pipeline.forward": {"name": "top_k", "fraction": 0.1}},
        "both": {
            "pipeline.forward": {"name": "top_k", "fraction": 0.1},
            "pipeline.backward": {"name": "top_k", "fraction": 0.1},
        },
    }
    out = train.apply_overrides(_config(), {**presets["both"], "seed": 3})
    assert out.pipeline.backward.fraction == 0.1 and out.seed == 3
    out = train.apply_overrides(_config(), presets["forward-only"])
    assert out.pipeline.backward == "identity"


def test_numbers_may_change_between_int_and_float_and_none_where_the_default_is():
    out = train.apply_overrides(_config(), {"lr": 1, "grad_clip_norm": 1.0})
    assert out.lr == 1 and out.grad_clip_norm == 1.0
    out = train.apply_overrides(out, {"grad_clip_norm": None})
    assert out.grad_clip_norm is None


@pytest.mark.parametrize(
    "text, value",
    [
        ("0.05", 0.05),
        ("1e-3", 1e-3),
        ("(64, 64)", (64, 64)),
        ("{'name': 'top_k', 'fraction': 0.1}", {"name": "top_k", "fraction": 0.1}),
        ("None", None),
        ("True", True),
        ("adam", "adam"),
        ("'adam'", "adam"),
        ("top_k", "top_k"),
        ("[('data', 8)]", [("data", 8)]),
    ],
)
def test_set_values_are_python_literals_or_bare_strings(text, value):
    assert train.parse_overrides([f"key={text}"]) == {"key": value}


def test_cli_and_api_agree():
    items = ["pipeline.backward=top_k", "pipeline.backward.fraction=0.05", "lr=0.01"]
    cli = train.apply_overrides(_config(), train.parse_overrides(items))
    api = train.apply_overrides(
        _config(), {"pipeline.backward": "top_k", "pipeline.backward.fraction": 0.05, "lr": 0.01}
    )
    assert cli.to_dict() == api.to_dict()
    assert train.parse_overrides(["lr=1", "lr=2"]) == {"lr": 2}


def test_high_links_are_codec_specs_like_forward_and_backward():
    # a bare name, then a dotted key into it (the CLI's --set forward_high=top_k ...fraction=0.05)
    items = [
        "pipeline.forward_high=quantize",
        "pipeline.forward_high.bits=4",
        "pipeline.backward_high=top_k",
        "pipeline.backward_high.fraction=0.05",
    ]
    out = train.apply_overrides(_config(), train.parse_overrides(items))
    assert out.pipeline.forward_high.to_dict() == {"name": "quantize", "bits": 4}
    assert out.pipeline.backward_high.to_dict() == {"name": "top_k", "fraction": 0.05}
    # descending into a high link the config gives as a bare name
    c = _config()
    c.pipeline.forward_high = "top_k"
    out = train.apply_overrides(c, {"pipeline.forward_high.fraction": 0.1})
    assert out.pipeline.forward_high.to_dict() == {"name": "top_k", "fraction": 0.1}
    # None switches a high link off (its default): the fixed-links run of an adaptive config
    out = train.apply_overrides(out, {"pipeline.forward_high": None})
    assert out.pipeline.forward_high is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"pipeline.forward_high": "quantize:4"}, r"config\.pipeline\.forward_high\.name"),
        ({"pipeline.backward_high": "topk"}, r"config\.pipeline\.backward_high\.name"),
        ({"pipeline.forward_high": 4}, r"config\.pipeline\.forward_high is a codec spec"),
        # a dotted key into an unset high link: the spec would have no codec name
        ({"pipeline.forward_high.bits": 4}, r"config\.pipeline\.forward_high has no codec name"),
        (
            {"pipeline.forward_high": "quantize", "pipeline.forward_high.bitz": 4},
            r"pipeline\.forward_high\.bitz",
        ),
        (
            {"pipeline.backward_high": "quantize", "pipeline.backward_high.bits": "four"},
            r"config\.pipeline\.backward_high\.bits must be a number",
        ),
    ],
)
def test_an_invalid_high_link_spec_is_an_error_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        train.apply_overrides(_config(), overrides)
