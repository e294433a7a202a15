"""Small configs shared by the trainer tests (dense digits: compiles in a few seconds)."""

import math
import os

import ml_collections
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _metrics
from jaxcomp.train import _writers

_PLOT = _metrics.plot_metrics


def digits_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "dense"
    c.mesh = [("data", 8)]
    c.model_name = "mlp"
    c.model = dict(hidden=(32, 32, 32))
    c.data_name = "digits"
    c.batch_size = 64
    c.eval_batch_size = 120
    c.total_steps = 12
    c.optax_name = "adam"
    c.lr = 3e-3
    c.log_every = 4
    c.checkpoint_every = 4
    for k, v in overrides.items():
        c[k] = v
    return c


@pytest.fixture(scope="session")  # a pure function: module-scoped fixtures may use it
def make_config():
    return digits_config


#: the options of each mode on the digits MLP, small: the same programs in every test that
#: builds a mode from them (test_nonfinite.py, test_modes.py)
MODE_OPTIONS = {
    "dense": {},
    "data_parallel": {
        "data_parallel": {
            "transform": "compressed_mean",
            "codec": {"name": "top_k", "fraction": 0.1, "feedback": "ef"},
        }
    },
    "pipeline": {  # 2 stages, 2 microbatches: the smallest pipeline (a link each way)
        "mesh": [("stage", 2)],
        "model": {"hidden": (16,)},
        "batch_size": 32,
        "eval_batch_size": 32,
        "pipeline": {
            "num_microbatches": 2,
            "forward": {"name": "top_k", "fraction": 0.25, "feedback": "ef"},
        },
    },
    "ab": {
        "mesh": [("group", 2), ("member", 4)],
        "ab": {"warmup_steps": 1, "sync_every": 2, "full_rank_steps": 1, "inner": "adam"},
    },
}


def mode_config(mode: str, **overrides) -> ml_collections.ConfigDict:
    return digits_config(mode=mode, **{**MODE_OPTIONS[mode], **overrides})


@pytest.fixture(scope="session")
def make_mode_config():
    """``make_mode_config(mode, **overrides)``: :data:`MODE_OPTIONS`' config of ``mode``."""
    return mode_config


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``logdir``, as TensorBoard shows it (purged steps dropped)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def jsonl_scalars(workdir) -> dict[str, list[tuple[int, float]]]:
    """The numbers of ``metrics.jsonl`` as ``<split>/<key>`` series, rounded to float32 as an
    event file stores them."""
    out: dict[str, list] = {}
    for r in train.read_metrics(str(workdir)):
        for k, v in r.items():
            if k not in ("step", "split") and isinstance(v, (int, float)):
                out.setdefault(f"{r['split']}/{k}", []).append((r["step"], float(np.float32(v))))
    return out


def _event_files_hold_metrics(workdir) -> dict:
    """Every scalar of ``metrics.jsonl`` is in the event files at the same steps (NaN as NaN);
    returns the event files' series."""
    seen = tensorboard_scalars(os.path.join(workdir, _writers.TENSORBOARD_DIR))
    expected = jsonl_scalars(workdir)
    assert expected
    for tag, points in expected.items():
        got = seen.get(tag)
        assert got is not None, f"{tag} missing from the event files"
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got, points):
            assert a == b or (math.isnan(a) and math.isnan(b)), (tag, a, b)
    return seen


@pytest.fixture(scope="session")
def event_files():
    """``event_files(workdir)``: asserts the TensorBoard events of a run hold every scalar of
    its ``metrics.jsonl`` at the same steps; returns every series of the event files."""
    return _event_files_hold_metrics


@pytest.fixture(scope="module")
def eval_compiled_when_called():
    """For the module: a trainer setup compiles its evaluation programs when a test first
    evaluates, not beside its step (``jaxcomp._compile.compile_all`` given the setup's programs
    less those named ``eval*``). The modes call their jitted evaluation, never the executable
    compiled at setup (that compile only fills JAX's caches for the first call), so what runs
    is the same; a module whose tests run steps and never evaluate (a one-step check of the
    wiring) compiles no evaluation at all: a pipeline setup's two are ~30% of its compiles. A
    module asks for it with ``pytestmark``; one that counts a setup's compiles
    (tests/train/test_no_stall.py) must not."""
    from jaxcomp import _compile
    from jaxcomp.train import _dense
    from jaxcomp.train import _dp_mode
    from jaxcomp.train import _pipeline_mode

    real = _compile.compile_all

    def without_eval(lowered):
        return real({k: v for k, v in lowered.items() if not k.startswith("eval")})

    with pytest.MonkeyPatch.context() as mp:
        for module in (_compile, _dense, _dp_mode, _pipeline_mode):  # AB: _compile's
            mp.setattr(module, "compile_all", without_eval)
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_curves():
    """No ``metrics.png`` from the runs here: a finished run's plot takes 0.2-0.5 s of
    matplotlib (the tight layout's text measures, the PNG) and draws the metrics the tests
    compare. A test that checks the plot asks for :func:`curves`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_metrics, "plot_metrics", lambda workdir, path=None: None)
        yield


@pytest.fixture
def curves(monkeypatch):
    """For the test: a finished run draws ``metrics.png`` (:func:`_no_curves` undone)."""
    monkeypatch.setattr(_metrics, "plot_metrics", _PLOT)
