"""Bad input at the edge of the trainer and the CLI: one row per case, each a clear error that
names the problem."""

import contextlib
import io
import os
import pathlib
import re
import shutil

import ml_collections
import pytest

from jaxcomp import main
from jaxcomp import train

pytestmark = pytest.mark.usefixtures("fast_compiles")


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


# --- the CLI and the workdir -------------------------------------------------------------------
ROOT = pathlib.Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "digits_dense.py")
TINY = ["--set", "model.hidden=(32, 32, 32)", "--set", "total_steps=4"]


def _main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main.main(argv)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run of the tiny config (one checkpoint, at step 4)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    code, err = _main(["--config", f"{CONFIG}:smoke", "--workdir", str(workdir), *TINY])
    assert code == 0, err
    return workdir


def _fresh(finished, tmp_path):
    return tmp_path / "run"


def _file(finished, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def _under_file(finished, tmp_path):
    return _file(finished, tmp_path) / "sub"


def _copy(finished, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(finished, work)
    return work


def _without_record(finished, tmp_path):
    work = _copy(finished, tmp_path)
    os.remove(work / "experiment.json")
    return work


def _unreadable_record(finished, tmp_path):
    work = _copy(finished, tmp_path)
    (work / "experiment.json").write_text("{not json")
    return work


def _all_damaged(finished, tmp_path):
    work = _copy(finished, tmp_path)
    for data in (work / "checkpoints" / "4" / "state").rglob("d/*"):
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    return work


@pytest.mark.parametrize(
    "make, extra, match",
    [
        (_fresh, ["--set", "lr.x=1"], r"cannot set 'lr.x': config.lr is a number"),
        (_fresh, ["--set", "lr=abc"], r"config.lr must be a number .*got a string \('abc'\)"),
        (_fresh, ["--set", "lr"], r"--set expects KEY=VALUE"),
        (_fresh, ["--set", "total_steps=1.5"], r"config.total_steps must be a positive int"),
        (_file, [], r"workdir '.*a_file' is a file, not a directory"),
        (_under_file, [], r"cannot create workdir '.*a_file/sub': Not a directory"),
        (
            _without_record,
            ["--set", "lr=0.5"],
            r"holds a checkpoint \(step 4\) of another experiment \(its experiment.json is "
            r"missing\): the config differs in \['lr'\]",
        ),
        (_unreadable_record, [], r"experiment.json is unreadable"),
        (
            _all_damaged,
            ["--set", "total_steps=8"],
            r"no checkpoint in .* can be restored \(step 4: ",
        ),
        (
            _copy,
            ["--set", "total_steps=2"],
            r"holds a checkpoint at step 4, past config.total_steps = 2",
        ),
    ],
    ids=[
        "lr.x",
        "lr=abc",
        "set-without-value",
        "float-steps",
        "workdir-is-a-file",
        "workdir-under-a-file",
        "other-config-record-deleted",
        "record-unreadable",
        "all-checkpoints-damaged",
        "past-total-steps",
    ],
)
def test_bad_cli_input_is_one_line_naming_the_problem(finished, tmp_path, make, extra, match):
    workdir = make(finished, tmp_path)
    code, err = _main(["--config", f"{CONFIG}:smoke", "--workdir", str(workdir), *TINY, *extra])
    lines = err.strip().splitlines()
    assert code == main.EXIT_SETUP and len(lines) == 1, err
    assert lines[0].startswith("error: ") and re.search(match, lines[0]), lines[0]


@pytest.mark.parametrize(
    "config, match",
    [
        (f"{CONFIG}:smok", r"unknown config argument 'smok' in .*digits_dense.py accepts 'smoke'"),
        (f"{CONFIG}:", r"unknown config argument ''"),
        ("configs/nope.py", r"config file 'configs/nope.py' does not exist"),
    ],
    ids=["smok", "empty-arg", "missing-file"],
)
def test_bad_config_argument_is_one_line(tmp_path, config, match):
    code, err = _main(["--config", config, "--workdir", str(tmp_path / "run")])
    assert code == main.EXIT_SETUP and re.search(match, err), err
    assert not (tmp_path / "run").exists()
