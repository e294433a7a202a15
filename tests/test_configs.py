"""Every config in configs/ runs 2 training steps in ``:smoke`` mode (one process)."""

import importlib.util
import pathlib

import pytest

from jaxcomp import train

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.py"))


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_documents_its_run_and_smoke_trains_two_steps(path, tmp_path):
    module = load(path)
    doc = module.__doc__ or ""
    assert f"--config configs/{path.name}" in doc and "Expected" in doc, "docstring incomplete"
    full = train.with_defaults(module.get_config(None))  # the real run's keys are valid too
    assert full.total_steps > 2
    summary = train.train_and_evaluate(module.get_config("smoke"), str(tmp_path))
    assert summary["steps"] == 2
    assert summary["wire_bytes_per_step"] > 0
    assert summary["final_loss"] == summary["final_loss"]  # finite, not NaN
