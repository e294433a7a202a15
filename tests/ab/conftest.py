"""Fixtures of the AB-Training tests."""

import pytest

from jaxcomp.ab import _programs


@pytest.fixture(scope="session")
def with_programs():
    """``with_programs(build) -> (build(), programs)``: ``build`` makes one harness
    (``parallel.ab_data_parallel``), ``programs`` is the ``_programs.Programs`` it runs, so that
    a test compiles, reads or traces again one of its programs without a second harness (whose
    every program would compile again)."""

    def get(build):
        made = []

        class Recorded(_programs.Programs):
            def __post_init__(self):
                super().__post_init__()
                made.append(self)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_programs, "Programs", Recorded)
            harness = build()
        (programs,) = made
        return harness, programs

    return get
