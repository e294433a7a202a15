"""A study with a network axis: every cell at every (rate, hosts), each network calibrated
once, on a fake lab (the runs themselves are tested in test_network.py and test_dp_speed.py)."""

import contextlib
import textwrap

import pytest

from jaxcomp import lab
from jaxcomp import study
from jaxcomp.lab import _calibrate
from jaxcomp.lab import _lab
from jaxcomp.lab import _study
from jaxcomp.lab import _train

STUDY = '''
r"""A tiny network study.

  python -m jaxcomp.study run tiny --workdir runs/tiny
"""

CONFIG = "digits_accordion"
COMMON = {"total_steps": 4}
VARIANTS = {
    "dense": {"data_parallel.transform": "compressed_mean", "data_parallel.codec": "identity"},
    "psgd": {"data_parallel.transform": "compressed_mean",
             "data_parallel.codec": {"name": "power_sgd", "rank": 2, "feedback": "ef"}},
}
'''


def test_network_axis_puts_unlimited_first_for_every_host_count():
    axis = _study.network_axis(["10mbit", "100mbit", "10mbit"], [2, 4])
    assert list(axis) == ["unlimited-2h", "10mbit-2h", "100mbit-2h",
                          "unlimited-4h", "10mbit-4h", "100mbit-4h"]  # fmt: skip
    assert axis["100mbit-4h"] == (1e8, 4)


@pytest.fixture
def fake_lab(monkeypatch):
    """Records each lab opened, calibration made and config run."""
    log = {"labs": [], "calibrated": [], "runs": []}
    real = _lab.Lab

    @contextlib.contextmanager
    def fake(hosts, rate, topology, devices):
        lb = real(hosts, rate, topology, devices)
        log["labs"].append((hosts, rate, devices))
        yield lb

    def calibrate(lb, out_dir):
        log["calibrated"].append(lb.describe()["rate"])
        return {"network": lb.describe(), "fits": {}}

    def run_config(lb, config, workdir, *, overrides, calibration, **kw):
        log["runs"].append((kw["name"], lb.spec.rate_bit_s, lb.devices, tuple(overrides)))
        assert calibration["network"]["rate"] == lb.describe()["rate"]

    monkeypatch.setattr(_study._lab, "Lab", fake)
    monkeypatch.setattr(_calibrate, "calibrate", calibrate)
    monkeypatch.setattr(_train, "run_config", run_config)
    return log


def test_every_cell_runs_at_every_network_point(fake_lab, tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(STUDY))
    s = study.load_study(str(path))
    statuses = lab.run_network_study(s, str(tmp_path / "w"), rates=["100mbit"], hosts=[2],
                                     log=lambda *a: None)  # fmt: skip
    assert statuses == {f"{v}__network={n}-2h__seed0": "done"
                        for v in ("dense", "psgd") for n in ("unlimited", "100mbit")}  # fmt: skip
    assert sorted(fake_lab["calibrated"]) == ["100mbit", "unlimited"]  # once per network
    runs = {name: (rate, devices) for name, rate, devices, _ in fake_lab["runs"]}
    assert runs["psgd__network=100mbit-2h__seed0"] == (1e8, 4)  # 8 devices over 2 hosts
    psgd_sets = [r[3] for r in fake_lab["runs"] if r[0].startswith("psgd")][0]
    assert "data_parallel.transform='compressed_mean'" in psgd_sets
