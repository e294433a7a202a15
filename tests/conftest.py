"""Test-suite setup: 8 fake CPU devices, set before the JAX backend starts."""

import atexit
import contextlib
import functools
import gc
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import warnings

import hypothesis
import pytest

# Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE, as in this project's CI
# containers, after an install with --no-compile), each process the suite starts (the xdist
# workers, the user-numerics runner, the CLI and multi-process children, the notebook kernels)
# compiled JAX, Flax, optax, orbax and jaxcomp from source again: ~1.3 CPU-s more per process
# (docs/results/suite_tiers, suite15 lead). The run's processes write and read their bytecode in
# one folder of the run instead (PYTHONPYCACHEPREFIX), not beside the sources; the process that
# made the folder removes it when it exits.
if sys.dont_write_bytecode and "PYTHONPYCACHEPREFIX" not in os.environ:
    _PYCACHE = tempfile.mkdtemp(prefix="jaxcomp-tests-pycache-")
    atexit.register(shutil.rmtree, _PYCACHE, ignore_errors=True)
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"

#: The env var that makes a pytest process compile with XLA:CPU's fusion emitters, the ones users
#: get, and run the ``user_numerics`` tests in-process (``tests/test_user_numerics.py`` starts
#: such a process; by hand: ``JAXCOMP_TEST_FUSION_EMITTERS=1 pytest -m user_numerics``).
FUSION_EMITTERS_ENV = "JAXCOMP_TEST_FUSION_EMITTERS"
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FUSION_EMITTERS = os.environ.get(FUSION_EMITTERS_ENV) == "1"
# Every other pytest process compiles with XLA:CPU's loop emitters (~25% less compile CPU for an
# optimised program, ~38% for an unoptimised one; the suite is compile-bound:
# docs/results/suite_tiers). The tests that pin XLA:CPU's numerics as users get them (marked
# ``user_numerics``) are deselected here and run in the fusion-emitter process instead. XLA reads
# its flags once, when the backend starts: set before JAX is imported.
flags = " ".join(f for f in flags.split() if f != LOOP_EMITTERS)
os.environ["XLA_FLAGS"] = flags if FUSION_EMITTERS else f"{flags} {LOOP_EMITTERS}".strip()

# Property tests are deterministic (the team rule: no flaky test): every run draws the same
# examples, few of them (``ci``, the default: a property test costs about one example test).
# HYPOTHESIS_PROFILE=thorough draws many more, still the same ones every run (before landing a
# change to a codec or a channel); HYPOTHESIS_PROFILE=explore draws new ones. A failure found
# either way becomes an explicit @example. Tests set no max_examples of their own: the profile
# decides.
hypothesis.settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=10, deadline=None
)
hypothesis.settings.register_profile(
    "thorough", derandomize=True, database=None, max_examples=200, deadline=None
)
hypothesis.settings.register_profile("explore", derandomize=False, max_examples=100, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# No persistent compilation cache in the suite (it shared one between its workers before): a
# cached multi-device XLA:CPU program was found to compute differently from a fresh compile
# (docs/results/accbug), so a test could pass or fail by whether its program was a hit. A
# developer's own cache settings must not leak into the tests or their CLI subprocesses.
for _name in ("JAXCOMP_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
    os.environ.pop(_name, None)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Python's cyclic garbage collector, left at its thresholds (700, 10, 10), ran ~3,700 collections
# and took ~9% of a test process's CPU walking the heap JAX, Flax and the tests' traces leave
# (docs/results/suite_tiers, suite14 lead): objects alive now (the imports) are moved out of its
# reach and it runs ~1% as often. Only when it runs changes, not what it frees; a test that
# needs garbage gone calls gc.collect() itself.
gc.collect()
gc.freeze()
gc.set_threshold(100_000, 50, 1000)
#: a folder whose ``sitecustomize`` sets the same thresholds in the processes the tests start
CHILD_SITE = pathlib.Path(__file__).with_name("child_site")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(CHILD_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
)

#: sizes of the fake tfds datasets of :func:`fake_tfds_dir` (32 images: two full batches of 16)
FAKE_IMAGES, FAKE_CHARS = 32, 1200


def _last_checkpoint(workdir: str):
    """``(step, state)`` of the newest checkpoint in a run's ``workdir``, the state the raw
    pytree orbax restores without a target."""
    import orbax.checkpoint as ocp

    from jaxcomp import train

    ckpt = train.Checkpointer(workdir)
    step = ckpt.all_steps()[-1]
    out = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ckpt.close()
    return step, out["state"]


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA's optimisation passes off (``jax_disable_most_optimizations``: backend level 0, no
    expensive LLVM passes) for a module whose tests check what a program computes to a
    tolerance or its wiring (a smoke run's steps, finite loss, bytes), not the bits of the
    optimised program: a test module asks for it with
    ``pytestmark = pytest.mark.usefixtures("fast_compiles")``. Compiling a ResNet-18 or VGG-16
    trainer step and state init is most of such a test's time (tests/pipeline runs so too,
    its conftest's ``_fast_compiles``). In the persistent cache the programs keep keys of their
    own (the options are part of the key); JAX's in-memory caches are cleared at the end, so
    that no later module's eager op or jitted function runs an executable compiled here.

    A test's JAX subprocess that compiles so (``JAX_DISABLE_MOST_OPTIMIZATIONS=1``: CLI,
    study, notebook and multi-process runs compared to a tolerance) also takes XLA:CPU's loop
    emitters, ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false``: its compiles take ~38% less
    CPU (docs/results/suite_tiers), as the pytest processes themselves do (above: all but the
    ``user_numerics`` run)."""
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _optimisations_as_declared(request):
    """A test that does not ask for ``fast_compiles`` runs with XLA's optimisations on: a flag
    left on by another module would make its bit pins check the unoptimised program
    (tests/pipeline's package-scoped fixture stayed on for the rest of each worker's session
    until 2026-12-02, and a bit pin of the optimised init then failed in the full suite)."""
    if not {"fast_compiles", "_fast_compiles"} & set(request.fixturenames):
        assert not jax.config.read("jax_disable_most_optimizations"), (
            "jax_disable_most_optimizations is on in a test that did not ask for it: a fixture "
            "or test before it left it on."
        )
    yield


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """A test leaves SIGINT's and SIGTERM's handlers as it found them: a handler left behind
    (SIGINT ignored was, in the full suite of 2026-12-05) is inherited as "ignored" by every
    process a later test starts, which then never sees the signal. A leak is put right and
    reported as a warning naming the test."""
    import signal
    import warnings

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in before.items():
        now = signal.getsignal(s)
        if now is not handler and handler is not None:
            signal.signal(s, handler)
            warnings.warn(f"{request.node.nodeid} left {s.name}'s handler as {now!r}", stacklevel=1)


#: the trainer setups built by :func:`shared_setups` in this process
_SETUPS: dict = {}


@pytest.fixture(scope="module")
def shared_setups():
    """For the module: ``jaxcomp.train.setup`` (and the trainer's own call) returns a setup
    built once per process for the same config, devices and compile setting (setup is pure:
    the compiled programs, mesh, loaders and mode of a config), so that each in-process run
    of a config after the first, in this module or a later one, compiles nothing: a resumed
    run, a rerun, a reference. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("shared_setups")``; a test that counts what a
    setup compiles must not (tests/train/test_no_stall.py)."""
    from jaxcomp import train
    from jaxcomp.train import _trainer

    setup = _load_test_module("shared_setups.py").caching(_trainer.setup, _SETUPS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_trainer, "setup", setup)
        mp.setattr(train, "setup", setup)
        yield setup


@pytest.fixture(scope="session")  # conftest functions are not importable in importlib mode
def last_checkpoint():
    """:func:`_last_checkpoint`: ``last_checkpoint(workdir) -> (step, state)``."""
    return _last_checkpoint


@functools.cache
def _load_test_module(path: str):
    """The file ``tests/<path>`` loaded as a module of its own name, once per process."""
    file = pathlib.Path(__file__).parent / path
    name = "_test_module_" + path.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_test_module():
    """``load_test_module("transforms/test_user_protocol.py")``: another test file's module, for
    its helpers (test files are not importable in importlib mode; loaded once per process)."""
    return _load_test_module


@pytest.fixture(scope="session")
def fake_tfds_dir(tmp_path_factory):
    """A tfds data_dir with fake ``cifar10`` (``FAKE_IMAGES`` images per split, label ``i % 10``)
    and ``tiny_shakespeare`` (``FAKE_CHARS`` characters of the pydoc corpus per split), in
    array_record, written once per test session (no TensorFlow, no download)."""
    from jaxcomp import data

    d = str(tmp_path_factory.mktemp("fake_tfds"))
    data.write_fake_tfds("cifar10", d, num_examples=FAKE_IMAGES)
    data.write_fake_tfds("tiny_shakespeare", d, num_chars=FAKE_CHARS)
    return d


@pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (pytest-xdist compares them). The tests of
    the other emitters are deselected (:func:`_deselect_by_emitters`). The user-numerics runner
    (the longest test: a pytest subprocess) runs first, then the modules by their seconds in
    ``tests/durations.json``, longest first, each module's tests together: pytest-xdist hands out
    tests in this order, so the long ones start early and the short ones fill both workers at
    the end (ordered by whether a module held a ``slow`` test, a 32-second test was handed out
    late and one worker ran alone for 34 s: docs/results/suite_tiers, suite15 lead). A module
    not in the file counts as :data:`UNLISTED_SLOW_S` if it holds a ``slow`` test, else 0;
    ``tools/suite_profile.py PROFILE durations tests/durations.json`` writes the file again."""
    _deselect_by_emitters(config, items)
    _check_also_under_set_mesh(items)
    unstable = [item.nodeid for item in items if " at 0x" in item.nodeid]
    if unstable:
        raise ValueError(
            "test ids contain object addresses, which differ between xdist workers; pass "
            f"ids= to parametrize: {unstable[:3]}"
        )
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def longest_first(item):
        module = item.nodeid.split("::")[0]
        runner = item.nodeid.startswith(USER_NUMERICS_RUNNER)
        return not runner, -seconds.get(module, UNLISTED_SLOW_S if module in slow else 0.0)

    items.sort(key=longest_first)  # stable: a module's tests keep their order, together


#: each test module's seconds in a profiled run (:func:`pytest_collection_modifyitems`)
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
#: the seconds assumed for a module missing from :data:`DURATIONS` that holds a ``slow`` test
UNLISTED_SLOW_S = 5.0


#: the test that runs the ``user_numerics`` tests in a fusion-emitter process
USER_NUMERICS_RUNNER = "tests/test_user_numerics.py::"
_DESELECTED = pytest.StashKey[list]()


def _deselect_by_emitters(config, items):
    """The loop-emitter processes deselect the ``user_numerics`` tests (kept, for
    :func:`user_numerics_deselected`, for the runner that runs them with the fusion emitters);
    the fusion-emitter process deselects the runner."""
    if FUSION_EMITTERS:
        drop = [item for item in items if item.nodeid.startswith(USER_NUMERICS_RUNNER)]
    else:
        drop = [item for item in items if item.get_closest_marker("user_numerics")]
    config.stash[_DESELECTED] = [item.nodeid for item in drop]
    if drop:
        ids = set(config.stash[_DESELECTED])
        items[:] = [item for item in items if item.nodeid not in ids]
        config.hook.pytest_deselected(items=drop)
    if not FUSION_EMITTERS and drop:
        if not any(item.nodeid.startswith(USER_NUMERICS_RUNNER) for item in items):
            warnings.warn(
                f"{len(drop)} user_numerics tests deselected and not run (their runner, "
                f"{USER_NUMERICS_RUNNER.rstrip(':')}, is not in this run): run them with "
                f"{FUSION_EMITTERS_ENV}=1 pytest -m user_numerics ...",
                pytest.PytestWarning,
                stacklevel=1,
            )


@pytest.fixture(scope="session")
def user_numerics_deselected(request):
    """The ids of the ``user_numerics`` tests this process collected and deselected (empty in
    the fusion-emitter process, which runs them)."""
    return [] if FUSION_EMITTERS else list(request.config.stash.get(_DESELECTED, []))


def _check_also_under_set_mesh(items):
    """Every :data:`ALSO_UNDER_SET_MESH` test of a collected file exists (a renamed test must
    not silently drop out of the set)."""
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    missing = [
        n
        for n in ALSO_UNDER_SET_MESH
        if modules.get(n.split("::")[0]) is not None
        and not hasattr(modules[n.split("::")[0]], n.split("::")[1])
    ]
    if missing:
        raise ValueError(f"tests/conftest.py ALSO_UNDER_SET_MESH names missing tests: {missing}")


def pytest_addoption(parser):
    parser.addoption(
        "--set-mesh",
        action="store_true",
        help="run every test that takes a mesh fixture (mesh, stage_mesh, ...) inside "
        "`with jax.set_mesh(mesh):`, JAX's recommended way to set a mesh; the code under test "
        "must not depend on whether a mesh context is set",
    )


#: Tests that every run (CI included) also runs under ``jax.set_mesh`` of their mesh (a second
#: parametrization, ``[set_mesh]``): a representative, cheap set of mesh-using tests, the pipeline
#: step and evaluate, data parallelism (flat and over a (slow, fast) pair) and AB-Training's
#: grouped step (Accordion's switch runs under it in
#: ``test_accordion.py::test_state_survives_orbax_and_the_run_continues_identically``).
#: ``pytest --set-mesh`` runs
#: every Mesh-fixture test so.
ALSO_UNDER_SET_MESH = (
    "tests/pipeline/test_gpipe.py::test_identity_mlp_matches_unpipelined",
    "tests/pipeline/test_compressed.py::"
    "test_compressed_evaluation_applies_each_forward_codec_with_the_documented_keys",
    "tests/parallel/test_data_parallel.py::test_identity_compression_equals_full_batch_training",
    "tests/parallel/test_data_parallel_pair.py::test_per_worker_state_belongs_to_a_slow_worker",
    "tests/ab/test_parallel.py::test_truncation_cuts_the_rank_and_capacity_can_follow",
    "tests/comm/test_uniformity.py::test_the_set_mesh_option_wraps_tests_taking_a_mesh",
)


@pytest.fixture
def under_set_mesh(request):
    """Whether this run of an :data:`ALSO_UNDER_SET_MESH` test is the ``jax.set_mesh`` one."""
    return request.param


@functools.cache
def _codec_table():
    """``tests/codecs.py``'s :data:`CODEC_TABLE` (loaded once per process)."""
    return _load_test_module("codecs.py").CODEC_TABLE


@pytest.fixture(scope="session")
def codec_table():
    """Every row of ``tests/codecs.py``'s table (for a test that needs the other rows)."""
    return _codec_table()


def pytest_generate_tests(metafunc):
    if "codec_case" in metafunc.fixturenames:  # one test per row of the codec table
        marker = metafunc.definition.get_closest_marker("codec_rows")
        keep = marker.args[0] if marker else (lambda case: True)
        rows = [case for case in _codec_table() if keep(case)]
        slow = [pytest.mark.slow]
        rows = [pytest.param(c, id=c.name, marks=() if c.fast else slow) for c in rows]
        metafunc.parametrize("codec_case", rows)
    if metafunc.definition.nodeid.split("[")[0] in ALSO_UNDER_SET_MESH:
        metafunc.fixturenames.append("under_set_mesh")
        metafunc.parametrize(
            "under_set_mesh", [False, True], ids=["no_set_mesh", "set_mesh"], indirect=True
        )


def _meshes(item, deep=False):
    """The Mesh fixtures of a test (``deep``: also a mesh inside a tuple fixture or its
    elements' ``.mesh``, e.g. AB-Training's ``(config, dp)``)."""
    args = getattr(item, "funcargs", {}) or {}
    values = list(args.values())
    if deep:
        for v in list(values):
            parts = v if isinstance(v, tuple) else (v,)
            values += [getattr(p, "mesh", p) for p in parts]
    return [v for v in values if isinstance(v, jax.sharding.Mesh)]


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """With ``--set-mesh``: the test body runs under ``jax.set_mesh`` of its mesh fixture; so
    does the ``[set_mesh]`` run of an :data:`ALSO_UNDER_SET_MESH` test."""
    variant = getattr(pyfuncitem, "callspec", None)
    variant = variant is not None and variant.params.get("under_set_mesh", False)
    meshes = _meshes(pyfuncitem) if pyfuncitem.config.getoption("--set-mesh") else []
    if variant:
        meshes = _meshes(pyfuncitem, deep=True)
        if not meshes:
            raise ValueError(f"{pyfuncitem.nodeid} is in ALSO_UNDER_SET_MESH but has no mesh.")
    ctx = jax.set_mesh(meshes[0]) if meshes else contextlib.nullcontext()
    with ctx:
        yield
