"""Every config in configs/ runs 2 training steps in ``:smoke`` mode (one process), but those
whose smoke trains elsewhere (:data:`LOWERED_ONLY`): set up and lowered, not compiled.

Paper-scale configs read CIFAR-10 / a text corpus through tfds; their smoke variants run on a
generated copy in tfds format (``data.fake``; nothing downloads), and without the prepared
dataset the real runs stop with the one-line prepare message.
"""

import importlib.util
import json
import math
import pathlib
import re

import pytest

from jaxcomp import _compile
from jaxcomp import data
from jaxcomp import main
from jaxcomp import models
from jaxcomp import train
from jaxcomp.train import _dense
from jaxcomp.train import _dp_mode
from jaxcomp.train import _metrics
from jaxcomp.train import _pipeline_mode

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


#: the smallest GPT config (dense) smoke-trains on a generated tfds text corpus
#: (tiny_shakespeare, ``fake_tfds_dir``) instead of its pydoc text: the tfds text source through
#: the trainer in that config's one compile (was a second run of it); its model and mode are
#: the same, and the pydoc source with its identity and reference runs in the other four text
#: configs (gpt_lm_pipeline, text_gpt_accordion, _ab, _pipeline); the pipeline config's tfds
#: wiring: the prepare-message test below
ON_TFDS_TEXT = CONFIGS[0].with_name("text_gpt_dense.py")


#: configs whose smoke trains elsewhere: set up (every key validated, the data read, the model
#: and mode built, every program traced and lowered), but nothing compiles or runs here (a
#: compile is most of a smoke's CPU, docs/results/suite_tiers). Name -> where it trains: a
#: config here whose smoke has its model and mode (other codec, schedule or optimizer keys,
#: which train where the comments say), or a test file that trains this smoke config as it is
LOWERED_ONLY = {
    # gpt_lm_pipeline's smoke model, mesh, microbatches and links (TopK 10% per sample,
    # shared mask); Adam at a constant rate where that one has AdamW and a warm-up cosine
    "text_gpt_pipeline": "gpt_lm_pipeline",
    # digits_pipeline's; 1F1B with the replicas averaged by PowerSGD + EF trains in
    # tests/train/test_two_processes.py (its "pipeline" case) and tests/pipeline
    "digits_pipeline_1f1b_powersgd": "digits_pipeline",
    # digits_pipeline's; adaptive links with their detector train in test_two_processes'
    # "pipeline" case and tests/pipeline/test_adaptive*.py
    "digits_pipeline_accordion": "digits_pipeline",
    # resnet18_cifar10_accordion_topk's (its TopK step compiles in less than half the
    # time); Accordion with PowerSGD rank 2 / 1 (these codecs) trains in digits_accordion
    "resnet18_cifar10_accordion_powersgd": "resnet18_cifar10_accordion_topk",
    # the CLI's cold, warm and damaged-cache runs (optimised; tests/train/test_no_stall.py
    # trains it with its own overrides)
    "digits_ab": "tests/test_compile_cache.py",
    # the installed wheel's main job (also through the CLI: test_main.py, test_faults.py)
    "digits_dense": "tests/test_package.py",
}


class _Lowered(BaseException):  # not an Exception: setup's error handling lets it through
    """Raised in place of the setup's compile: every program it would compile, lowered."""

    def __init__(self, programs):
        super().__init__(sorted(programs))
        self.programs = programs


def _lowers_only(lowered):
    raise _Lowered({n: p if hasattr(p, "compile") else p() for n, p in lowered.items()})


def _sets_up_without_compiling(config):
    """The setup of ``config`` up to its compile: the lowered programs by name."""
    with pytest.MonkeyPatch.context() as mp:
        for module in (_compile, _dense, _dp_mode, _pipeline_mode):
            mp.setattr(module, "compile_all", _lowers_only)
        with pytest.raises(_Lowered) as lowered:
            train.setup(config)
    return lowered.value.programs


def test_a_lowered_only_config_trains_where_it_says():
    for name, where in LOWERED_ONLY.items():
        if where.startswith("tests/"):  # that file trains this config's smoke as it is
            text = (CONFIGS[0].parents[1] / where).read_text()
            assert re.search(rf"\b{name}\b", text) and ":smoke" in text, (name, where)
            continue
        smoke, other = (
            load(CONFIGS[0].with_name(f"{n}.py")).get_config("smoke") for n in (name, where)
        )
        assert where not in LOWERED_ONLY, name
        assert (smoke.mode, smoke.model_name, smoke.data_name) == (
            other.mode,
            other.model_name,
            other.data_name,
        ), name
        assert smoke.model.to_dict() == other.model.to_dict(), name


def _documents_its_run_and_smoke_trains_two_steps(path, workdir, tfds_dir=None):
    module = load(path)
    doc = module.__doc__ or ""
    assert f"--config configs/{path.name}" in doc and "Expected" in doc, "docstring incomplete"
    full = train.with_defaults(module.get_config(None))  # the real run's keys are valid too
    assert full.total_steps > 2
    if full.mode == "pipeline":  # the real run's stages fill its mesh (a smoke may run fewer)
        stages = models.get_model(full.model_name, **dict(full.model)).num_stages
        assert dict(full.mesh)["stage"] == stages <= full.pipeline.num_microbatches, path.stem
    smoke = module.get_config("smoke")
    if path in PAPER_SCALE:  # the smoke variant reads the real run's dataset, not a stand-in
        assert (smoke.data_name, smoke.data.name) == (full.data_name, full.data.name)
        assert "GPU" in doc and "tfds build" in doc
        assert smoke.data.fake  # generated images (data.write_fake_tfds): no download
    if tfds_dir is not None:
        assert smoke.data_name == "pydoc_text"
        smoke.data_name = "tfds_text"  # tiny_shakespeare by default
        smoke.data.data_dir = tfds_dir
        smoke.eval_data = {}
    if path.stem in LOWERED_ONLY:
        programs = _sets_up_without_compiling(smoke)
        steps = {"dense", "ab"} if smoke.mode == "ab" else {"train_step"}  # AB: its step kinds
        assert steps <= {n.split("(")[0] for n in programs}, programs
        return
    with pytest.MonkeyPatch.context() as mp:  # no curves: the PNG is drawn from metrics.jsonl
        # whatever the config (tests/train/test_trainer.py): ~0.2 s of matplotlib per smoke
        mp.setattr(_metrics, "plot_metrics", lambda workdir, path=None: None)
        summary = train.train_and_evaluate(smoke, str(workdir))
    assert summary["steps"] == 2
    assert summary["wire_bytes_per_step"] > 0
    assert summary["final_loss"] == summary["final_loss"]  # finite, not NaN
    if smoke.data_name.endswith("_text"):
        assert summary["final_perplexity"] == summary["final_perplexity"]
    if smoke.data_name == "pydoc_text":  # the embedded text: its identity and the reference
        on_disk = json.loads((workdir / "summary.json").read_text())
        assert on_disk["dataset"]["corpus_sha256"] == data.pydoc_corpus()[1]
        assert on_disk["dataset"]["files"][0]["path"] == "pydoc_data/topics.py"
        assert on_disk["unigram_perplexity"] == on_disk["dataset"]["unigram_perplexity"] > 1
        final = train.read_metrics(str(workdir))[-1]
        assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))
        assert summary["final_perplexity"] == final["perplexity"]


@pytest.mark.slow  # a setup per config, ResNet-18, VGG-16 and the GPT pipelines among them
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_documents_its_run_and_smoke_trains_two_steps(path, tmp_path, request):
    tfds_dir = request.getfixturevalue("fake_tfds_dir") if path == ON_TFDS_TEXT else None
    _documents_its_run_and_smoke_trains_two_steps(path, tmp_path, tfds_dir)


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
