"""Resume on another split of processes and devices (issue 37, item 4): supported when the
mesh comes out the same, refused when it does not (another device count: a ``-1`` mesh axis
would get other sizes, a fixed one cannot be formed), with one line naming both. The check's
cases here; the runs (2 processes x 2 devices <-> 1 x 4: the same numbers as an uninterrupted
run, and 1 x 8 refused before anything compiles) are tests/train/test_two_processes.py's
dense case, which shares its launch.
"""

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _workdir


def _saved(processes, per_process, mesh=None, step=4):
    topology = {"processes": processes, "devices_per_process": per_process, "platform": "cpu"}
    if mesh is not None:
        topology["mesh"] = mesh
    return step, {"topology": topology}


def _now(processes, per_process):
    return {"processes": processes, "devices_per_process": per_process, "platform": "cpu"}


def test_mesh_sizes_fill_the_free_axis_or_say_none():
    assert _workdir.mesh_sizes([("data", -1)], 8) == {"data": 8}
    assert _workdir.mesh_sizes([("data", 2), ("stage", -1)], 8) == {"data": 2, "stage": 4}
    assert _workdir.mesh_sizes([("data", 4)], 8) == {"data": 4}  # the first 4 devices
    assert _workdir.mesh_sizes([("data", 8)], 4) is None
    assert _workdir.mesh_sizes([("data", 3), ("stage", -1)], 8) is None
    assert _workdir.mesh_sizes([("data", 0)], 8) is None  # make_mesh names it


@pytest.mark.parametrize(
    "axes, saved, now, refused",
    [
        ([("data", -1)], _saved(2, 4, {"data": 8}), _now(1, 8), None),
        ([("data", 8)], _saved(1, 8, {"data": 8}), _now(2, 4), None),
        ([("data", 4)], _saved(1, 8, {"data": 4}), _now(1, 4), None),  # the same 4 used
        ([("data", -1)], _saved(2, 4, {"data": 8}), _now(1, 4), "give config.mesh"),
        ([("data", 8)], _saved(2, 4, {"data": 8}), _now(1, 4), "cannot form config.mesh"),
        ([("data", -1)], _saved(2, 4), _now(2, 2), "give config.mesh"),  # no mesh recorded
        ([("data", -1)], (4, {}), _now(1, 4), None),  # no topology recorded: nothing to say
    ],
)
def test_another_mesh_is_refused_in_one_line_naming_both(axes, saved, now, refused, tmp_path):
    if refused is None:
        _workdir.check_topology(str(tmp_path), saved, axes, now)
        return
    with pytest.raises(train.SetupError) as e:
        _workdir.check_topology(str(tmp_path), saved, axes, now)
    line = str(e.value)
    assert "\n" not in line and refused in line, line
    assert f"checkpoint step 4 in {tmp_path} was computed on mesh {{'data': 8}} by 2 " in line
    assert f"this run's {now['processes']} process(es) x {now['devices_per_process']} cpu" in line
    assert "Resume on 8 devices, or use a new --workdir." in line


def test_a_mesh_on_some_of_the_devices_saves_its_own_device_count():
    """A run on 4 of the process's 8 devices computed on 4: its checkpoint says so (it said 8,
    and a resume then named 8 devices, or, for a checkpoint without its mesh, refused a resume
    on the same 4)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    saved = _workdir.topology(mesh)
    assert saved["devices_per_process"] == 4 and saved["mesh"] == {"data": 4}
    legacy = {k: v for k, v in saved.items() if k != "mesh"}
    now = {"processes": 1, "devices_per_process": 4, "platform": "cpu"}
    _workdir.check_topology("w", (3, {"topology": legacy}), [("data", -1)], now)  # no error
