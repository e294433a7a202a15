"""Test-suite setup: 8 fake CPU devices, set before the JAX backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (pytest-xdist compares them)."""
    unstable = [item.nodeid for item in items if " at 0x" in item.nodeid]
    if unstable:
        raise ValueError(
            "test ids contain object addresses, which differ between xdist workers; pass "
            f"ids= to parametrize: {unstable[:3]}"
        )
