"""The numbers the README and the digits configs state are the ones ``headline.json`` records,
with the commit and the jax/jaxlib versions that produced them (regenerated and rechecked by
``python docs/results/headline/regenerate.py [--check]``, ~4 minutes: not run here)."""

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
HEADLINE = ROOT / "docs" / "results" / "headline"
RECORD = json.loads((HEADLINE / "headline.json").read_text())


def _regenerate():
    spec = importlib.util.spec_from_file_location("jaxcomp_headline", HEADLINE / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pct(x: float) -> str:
    """An accuracy as the README writes it: 352 of 359 test images -> ``98.05%``."""
    return f"{100 * x:.2f}%"


def test_every_config_is_recorded_with_its_stamp():
    stamp = RECORD["stamp"]
    assert re.fullmatch(r"[0-9a-f]{40}", stamp["commit"]) and stamp["dirty"] is False
    assert stamp["jax"] and stamp["jaxlib"] and stamp["date"]
    assert set(RECORD["configs"]) == set(_regenerate().CONFIGS)


TABLE = sorted(n for n in RECORD["configs"] if (ROOT / "configs" / f"{n}.py").exists())


@pytest.mark.parametrize("name", TABLE)
def test_readme_row_and_config_docstring_quote_the_recorded_accuracy(name):
    numbers = RECORD["configs"][name]
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
    quoted = [pct(numbers["final_accuracy"])]
    if "final_accuracy_uncompressed" in numbers:
        quoted.append(pct(numbers["final_accuracy_uncompressed"]))
    doc = (ROOT / "configs" / f"{name}.py").read_text().split('"""')[1]
    for text in quoted:
        assert text in row, (name, text, row)
        assert text in " ".join(doc.split()), (name, text)
    # every percentage the row states is one of the recorded ones; its first "N.Nx fewer"
    # is the run's compression ratio
    assert set(re.findall(r"\d+\.\d+%", row)) <= set(quoted), (name, row)
    ratios = re.findall(r"(\d+\.\d+)× fewer", row)
    assert not ratios or ratios[0] == f"{numbers['compression_ratio']:.1f}", (name, row)


def test_readme_headline_quotes_the_main_job():
    numbers = RECORD["configs"]["digits_pipeline"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    on, off = pct(numbers["final_accuracy"]), pct(numbers["final_accuracy_uncompressed"])
    assert f"The main job reaches {on} test accuracy with boundary compression on" in readme
    assert f"and {off} with it off, sending" in readme
