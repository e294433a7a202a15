"""Which collectives of a data-parallel step reach the link (the placement by group size;
priced through a lab run in tests/study/test_network.py)."""

from jaxcomp.study import _dp_model


def test_a_group_the_mesh_cannot_place_has_no_share():
    """2 x 2 (slow, fast): a group of 2 is either axis, so the model does not guess (the
    placed cases: the docstring's example)."""
    assert _dp_model.nic_share(2, [["slow", 2], ["fast", 2]], 2, 2) is None
