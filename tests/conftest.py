"""Test-suite setup: 8 fake CPU devices, set before the JAX backend starts."""

import contextlib
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def _compilation_cache_dir() -> str | None:
    """One persistent XLA compilation cache per test run and xdist worker (shared with the
    subprocesses a test launches, through the environment).

    Many tests compile a program another test (or an earlier step of the same test) already
    compiled: a resumed run recompiles the original run's step, the CLI tests launch one config
    several times, the smoke configs share models. A cache hit loads the same executable XLA
    built, so results are unchanged. One directory per worker: the cache writes its files
    without a lock. ``JAXCOMP_TEST_COMPILATION_CACHE=0`` turns it off."""
    if os.environ.get("JAXCOMP_TEST_COMPILATION_CACHE", "1") == "0":
        return None
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return os.path.join(tempfile.gettempdir(), f"jaxcomp-tests-xla-cache-{run[:12]}-{worker}")


_CACHE_DIR = _compilation_cache_dir()
if _CACHE_DIR and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
else:
    _CACHE_DIR = None  # a cache the caller chose is theirs to keep

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

#: sizes of the fake tfds datasets of :func:`fake_tfds_dir` (32 images: two full batches of 16)
FAKE_IMAGES, FAKE_CHARS = 32, 1200


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


def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (pytest-xdist compares them)."""
    unstable = [item.nodeid for item in items if " at 0x" in item.nodeid]
    if unstable:
        raise ValueError(
            "test ids contain object addresses, which differ between xdist workers; pass "
            f"ids= to parametrize: {unstable[:3]}"
        )


def pytest_addoption(parser):
    parser.addoption(
        "--set-mesh",
        action="store_true",
        help="run every test that takes a mesh fixture (mesh, stage_mesh, ...) inside "
        "`with jax.set_mesh(mesh):`, JAX's recommended way to set a mesh; the code under test "
        "must not depend on whether a mesh context is set",
    )


def _meshes(item):
    args = getattr(item, "funcargs", {}) or {}
    return [v for v in args.values() if isinstance(v, jax.sharding.Mesh)]


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """With ``--set-mesh``: the test body runs under ``jax.set_mesh`` of its mesh fixture."""
    meshes = _meshes(pyfuncitem) if pyfuncitem.config.getoption("--set-mesh") else []
    ctx = jax.set_mesh(meshes[0]) if meshes else contextlib.nullcontext()
    with ctx:
        yield


def pytest_sessionfinish(session, exitstatus):
    """Removes this worker's compilation cache (see :func:`_compilation_cache_dir`)."""
    if _CACHE_DIR:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
