"""A trainer setup built once per process and config: ``jaxcomp.train.setup`` is pure (the
compiled programs, mesh, loaders and mode of a config), so a later run of the same config in
the same process (a resumed run, a rerun, a reference) may take the first one's and compile
nothing. Used by the root conftest's ``shared_setups`` fixture and by the worker processes of
tests/train/test_two_processes.py (each resumes every case in the process that stopped it)."""

import jax


def caching(real, store: dict):
    """``real`` (``jaxcomp.train.setup``) answering from ``store`` for a config (with its
    defaults), devices and compile setting it has built before."""
    from jaxcomp import train

    def setup(config, devices=None):
        key = (
            train.with_defaults(config).to_json_best_effort(sort_keys=True),
            None if devices is None else tuple(d.id for d in devices),
            jax.config.read("jax_disable_most_optimizations"),
        )
        if key not in store:
            store[key] = real(config, devices=devices)
        return store[key]

    return setup
