"""Test-suite setup: 8 fake CPU devices, set before the JAX backend starts."""

import contextlib
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

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
