"""The lab report's calibration table shows each calibration's fits, the chain fit included."""

from jaxcomp.lab import _report


def _calibration(hosts, chain=None):
    fit = {"alpha_s": 1e-3, "beta_bit_s": 9.8e6, "max_rel_error": 0.02}
    record = {
        "network": {"topology": "per_host", "hosts": hosts, "devices_per_host": 1,
                    "rate": "10mbit"},
        "achieved": {"bit_s": 9.5e6},
        "fits": {"all-reduce": fit, "collective-permute": fit},
        "load_before": [2.3, 2.0, 1.9],
        "load_after": [1.7, 1.8, 1.9],
    }  # fmt: skip
    if chain is not None:
        record["chain"] = chain
    return record


def test_the_calibration_table_shows_the_chain_fit_where_one_was_probed():
    chain = {"offset_bytes": 5120.0, "cap_bytes": 47112.03, "max_abs_error_s": 0.0131}
    unbounded = {**chain, "cap_bytes": float("inf")}
    rows = _report.calibration_table(
        [_calibration(4, chain), _calibration(2), _calibration(3, unbounded)]
    ).splitlines()
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    at = head.index("chain o bytes")
    assert head[at : at + 3] == ["chain o bytes", "chain c bytes", "chain max error ms"]
    assert all(len(r) == len(head) for r in cells)
    assert cells[0][at : at + 3] == ["5,120", "47,112", "13.1"]
    assert cells[1][at : at + 3] == ["—", "—", "—"]  # 2 hosts: no chain probe
    assert cells[2][at : at + 3] == ["5,120", "none", "13.1"]
    assert cells[0][-1] == "2.3 / 1.7"
