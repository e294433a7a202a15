"""Bad input is a one-line ValueError naming the problem, raised before training starts."""

import pytest

from jaxcomp import train
from jaxcomp.train import _config


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"learning_rate": 0.1}, r"unknown config key\(s\) \['learning_rate'\]"),
        ({"model_name": "resnet50"}, "unknown model 'resnet50'"),
        ({"model": {"hidden": (8,), "depth": 2}}, r"unknown argument\(s\) \['depth'\]"),
        ({"data_name": "mnist"}, "unknown dataset 'mnist'"),
        ({"optax_name": "adamm"}, "unknown optimizer optax.adamm"),
        ({"mode": "zero"}, "config.mode must be one of"),
        ({"schedule": "linear"}, "config.schedule must be one of"),
        ({"mesh": [("data", 16)]}, "needs 16 devices; only 8 available"),
        ({"mesh": [("data", 3), ("stage", -1)]}, "not a multiple of 3"),
        ({"batch_size": 60}, "not divisible by the 8 devices"),
        (
            {"model": {"hidden": (8,), "num_classes": 12}},
            r"model 'mlp' has 12 outputs but dataset 'digits' has 10 classes: set "
            r"config.model.num_classes=10",
        ),
        (
            {"data_name": "synthetic_images", "data": {"shape": (8,), "num_classes": 3}},
            "has 10 outputs but dataset 'synthetic_images' has 3 classes",
        ),
        (
            {"data_parallel": {"codec": "top_k"}},
            r"unknown key\(s\) \['codec'\] in config.data_parallel",
        ),
        (
            {"mode": "data_parallel", "data_parallel": {"interval_epochs": 2, "interval_steps": 5}},
            r"config.data_parallel: give interval_epochs or interval_steps, not both",
        ),
    ],
)
def test_bad_config_is_a_clear_error_before_training(make_config, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match) as info:
        train.train_and_evaluate(make_config(**overrides), str(tmp_path))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "checkpoints").exists()


def test_missing_required_key(make_config, tmp_path):
    config = make_config()
    del config["total_steps"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['total_steps'\]"):
        train.train_and_evaluate(config, str(tmp_path))


def test_unknown_codec_and_feedback_names():
    with pytest.raises(ValueError, match="unknown codec 'topk'"):
        train.build_codec({"name": "topk", "fraction": 0.1})
    with pytest.raises(ValueError, match="bad arguments for codec 'quantize'"):
        train.build_codec({"name": "quantize", "bitz": 4})
    with pytest.raises(ValueError, match="unknown feedback 'ef3'"):
        train.build_channel({"name": "top_k", "fraction": 0.1, "feedback": "ef3"})
    assert train.build_channel(
        {"name": "top_k", "fraction": 0.1, "feedback": "ef"}
    ).name.startswith("error_feedback")


def test_a_detector_interval_is_given_in_epochs_or_in_steps():
    steps = _config.interval_steps
    assert steps("config.data_parallel", {}, 11) == 11  # one epoch by default
    assert steps("config.data_parallel", {"interval_epochs": 3}, 11) == 33
    assert steps("config.data_parallel", {"interval_steps": 25, "interval_epochs": None}, 11) == 25
    with pytest.raises(ValueError, match=r"config.data_parallel.interval_steps must be an integer"):
        steps("config.data_parallel", {"interval_steps": 2.5}, 11)
