"""Every config in configs/ runs 2 training steps in ``:smoke`` mode (one process).

Paper-scale configs read CIFAR-10 / a text corpus through tfds; their smoke variants run on a
generated copy in tfds format (``data.fake``; nothing downloads), and without the prepared
dataset the real runs stop with the one-line prepare message.
"""

import importlib.util
import json
import math
import pathlib

import pytest

from jaxcomp import data
from jaxcomp import main
from jaxcomp import train

#: the smoke runs check a config's wiring (2 steps, bytes sent, a finite loss), not the bits of
#: XLA's optimised program: compiling the ResNet-18 / VGG-16 / GPT steps and inits unoptimised
#: halves the compile time of the file's heaviest tests
pytestmark = pytest.mark.usefixtures("fast_compiles")

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.py"))


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAPER_SCALE = [p for p in CONFIGS if load(p).get_config(None).data_name.startswith("tfds_")]


def test_the_paper_scale_configs_are_found():
    names = {p.stem for p in PAPER_SCALE}
    assert names == {
        "resnet18_cifar10_pipeline",
        "resnet18_cifar10_accordion_powersgd",
        "resnet18_cifar10_accordion_topk",
        "vgg16_cifar10_ab",
    }


GPT = CONFIGS[0].with_name("gpt_lm_pipeline.py")


def _documents_its_run_and_smoke_trains_two_steps(path, workdir):
    module = load(path)
    doc = module.__doc__ or ""
    assert f"--config configs/{path.name}" in doc and "Expected" in doc, "docstring incomplete"
    full = train.with_defaults(module.get_config(None))  # the real run's keys are valid too
    assert full.total_steps > 2
    smoke = module.get_config("smoke")
    if path in PAPER_SCALE:  # the smoke variant reads the real run's dataset, not a stand-in
        assert (smoke.data_name, smoke.data.name) == (full.data_name, full.data.name)
        assert "GPU" in doc and "tfds build" in doc
        assert smoke.data.fake  # generated images (data.write_fake_tfds): no download
    summary = train.train_and_evaluate(smoke, str(workdir))
    assert summary["steps"] == 2
    assert summary["wire_bytes_per_step"] > 0
    assert summary["final_loss"] == summary["final_loss"]  # finite, not NaN
    if smoke.data_name == "pydoc_text":  # the embedded text: its identity and the reference
        on_disk = json.loads((workdir / "summary.json").read_text())
        assert on_disk["dataset"]["corpus_sha256"] == data.pydoc_corpus()[1]
        assert on_disk["dataset"]["files"][0]["path"] == "pydoc_data/topics.py"
        assert on_disk["unigram_perplexity"] == on_disk["dataset"]["unigram_perplexity"] > 1
        final = train.read_metrics(str(workdir))[-1]
        assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))
        assert summary["final_perplexity"] == final["perplexity"]


OTHERS = [p for p in CONFIGS if p != GPT]


@pytest.mark.slow  # a setup per config, ResNet-18 and VGG-16 among them
@pytest.mark.parametrize("path", OTHERS, ids=[p.stem for p in OTHERS])
def test_config_documents_its_run_and_smoke_trains_two_steps(path, tmp_path):
    _documents_its_run_and_smoke_trains_two_steps(path, tmp_path)


@pytest.mark.slow
def test_gpt_lm_config_smoke_trains_on_pydoc_and_on_a_tfds_text_corpus(tmp_path, fake_tfds_dir):
    _documents_its_run_and_smoke_trains_two_steps(GPT, tmp_path / "pydoc")
    # the tfds text source through the trainer: the smallest GPT config (dense, 2 blocks), not
    # a second compile of the 4-stage pipeline (the suite has no compilation cache); the
    # pipeline config's tfds wiring: the prepare-message test below
    c = load(GPT.with_name("text_gpt_dense.py")).get_config("smoke")
    c.data_name = "tfds_text"  # tiny_shakespeare by default
    c.data.data_dir = fake_tfds_dir
    c.eval_data = {}
    summary = train.train_and_evaluate(c, str(tmp_path / "tfds"))
    assert summary["steps"] == 2 and summary["final_perplexity"] == summary["final_perplexity"]


RUNS_WITHOUT_DATA = [(p.name, []) for p in PAPER_SCALE]
RUNS_WITHOUT_DATA.append(("gpt_lm_pipeline.py", ["--set", "data_name=tfds_text"]))


@pytest.mark.parametrize("name, extra", RUNS_WITHOUT_DATA, ids=[n for n, _ in RUNS_WITHOUT_DATA])
def test_without_the_dataset_a_run_prints_the_one_line_prepare_message(
    name, extra, tmp_path, capsys
):
    config = str(CONFIGS[0].with_name(name))
    empty = tmp_path / "no_data"
    empty.mkdir()
    argv = ["--config", config, "--workdir", str(tmp_path / "run")]
    argv += [*extra, "--set", f"data.data_dir={empty}"]
    assert main.main(argv) == 2
    err = capsys.readouterr().err.strip()
    dataset = "tiny_shakespeare" if extra else "cifar10"
    assert err.count("\n") == 0, err
    assert err.startswith(f"error: tfds dataset '{dataset}' (split 'train') is not prepared in")
    assert f"`tfds build {dataset} --file_format=array_record --data_dir={empty}`" in err
