"""Test-suite setup: 8 fake CPU devices, set before the JAX backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

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
