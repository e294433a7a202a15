"""The calibration's fit recovers the cost model's alpha and beta, on the formula of each kind."""

import pytest

from jaxcomp import lab
from jaxcomp.lab import _calibrate
from jaxcomp.study import _cost


def _points(kind, alpha, beta, w, sizes=(1e3, 1e4, 1e5, 1e6)):
    lk = _cost.NetworkLink(beta, alpha)
    return [{"bytes": n, "median_s": _cost.collective_time(kind, n, w, lk)} for n in sizes]


@pytest.mark.parametrize("kind, w", [("all-reduce", 8), ("collective-permute", 2),
                                     ("all-gather", 4)])  # fmt: skip
def test_fit_recovers_alpha_and_beta(kind, w):
    f = lab.fit_alpha_beta(kind, _points(kind, 2e-4, 1.2e7, w), w)
    assert f["alpha_s"] == pytest.approx(2e-4, rel=1e-9)
    assert f["beta_bytes_s"] == pytest.approx(1.2e7, rel=1e-9)
    assert f["beta_bit_s"] == pytest.approx(9.6e7, rel=1e-9) and f["max_rel_error"] < 1e-9
    link = _calibrate.link_of({"fits": {kind: f}}, kind)
    assert link == pytest.approx(_cost.NetworkLink(1.2e7, 2e-4))


def test_fit_keeps_alpha_non_negative_and_beta_finite():
    # pure bandwidth with a little noise that would make alpha negative
    pts = _points("all-reduce", 0.0, 1e7, 8)
    pts[0]["median_s"] *= 0.9
    f = lab.fit_alpha_beta("all-reduce", pts, 8)
    assert f["alpha_s"] == 0.0 and f["beta_bytes_s"] == pytest.approx(1e7, rel=0.05)
    # no measurable bandwidth term (an unlimited link): latency only, beta capped
    flat = [{"bytes": n, "median_s": 1e-3} for n in (1e3, 1e5)]
    f = lab.fit_alpha_beta("collective-permute", flat, 2)
    assert f["beta_bytes_s"] == _calibrate.MAX_BANDWIDTH
    assert f["alpha_s"] == pytest.approx(1e-3, rel=1e-3)  # less the capped beta's term


@pytest.mark.parametrize(
    "points, match",
    [([{"bytes": 1e3, "median_s": 1e-3}], "at least two"),
     ([{"bytes": 1e3, "median_s": 1e-3}, {"bytes": 1e4, "median_s": 0.0}], "positive")],
)  # fmt: skip
def test_fit_refuses_what_it_cannot_fit(points, match):
    with pytest.raises(ValueError, match=match):
        lab.fit_alpha_beta("all-reduce", points, 8)


def _bucket_points(alpha=5e-4, beta=1.2e6, burst=3028.0, sizes=(1024, 4096, 16384, 65536)):
    """A ping-pong through a token bucket: the first ``burst`` bytes pass free."""
    return [{"bytes": n, "median_s": alpha + max(n - burst, 0) / beta} for n in sizes]


def test_the_ping_pong_fit_knows_the_token_bucket():
    net = {"tbf": {"rate": "10000000bit", "burst": "3028", "latency": "400ms"}}
    f = _calibrate.point_to_point(_bucket_points(), net)
    assert f["burst_bytes"] == 3028.0 and f["max_rel_error"] < 1e-9
    assert f["alpha_s"] == pytest.approx(5e-4) and f["beta_bytes_s"] == pytest.approx(1.2e6)
    # the affine fit over every probe puts the same link ~35% faster than it is
    plain = lab.fit_alpha_beta("collective-permute", _bucket_points(), 2)
    assert plain["beta_bytes_s"] > 1.3 * 1.2e6 and plain["max_rel_error"] > 0.3
    # no bucket (unlimited), or fewer than two probes beyond it: the affine fit, burst 0
    for net in ({"tbf": None}, {"tbf": {"burst": "20000"}}):
        f = _calibrate.point_to_point(_bucket_points(burst=0.0), net)
        assert f["burst_bytes"] == 0.0 and f["beta_bytes_s"] == pytest.approx(1.2e6)


BAD_BURSTS = [
    ("all-reduce", 1e3, "collective-permute only"),
    ("collective-permute", -1.0, ">= 0"),
    ("collective-permute", float("nan"), ">= 0"),
]


@pytest.mark.parametrize("kind, burst, match", BAD_BURSTS)
def test_a_bad_burst_names_the_problem(kind, burst, match):
    with pytest.raises(ValueError, match=match):
        lab.fit_alpha_beta(kind, _bucket_points(), 2, burst)


def test_refit_replaces_only_a_ping_pong_fit_made_without_the_bucket():
    net = {"tbf": {"burst": "3028"}}
    old = lab.fit_alpha_beta("collective-permute", _bucket_points(), 2)
    del old["burst_bytes"]  # as calibrations stored before the bucket was modelled
    ar = lab.fit_alpha_beta("all-reduce", _points("all-reduce", 1e-4, 1e6, 4), 4)
    cal = {"network": net, "fits": {"all-reduce": ar, "collective-permute": old}}
    new = _calibrate.refit(cal)
    assert new["fits"]["all-reduce"] is ar and cal["fits"]["collective-permute"] is old
    f = new["fits"]["collective-permute"]
    assert f["beta_bytes_s"] == pytest.approx(1.2e6) and f["burst_bytes"] == 3028.0
    assert [p["median_s"] for p in f["points"]] == [p["median_s"] for p in old["points"][1:]]
    assert _calibrate.refit(new) is new


def _chain_points(offset, cap, beta=1.2e6, sizes=(4096, 8192, 16384, 32768, 65536, 131072)):
    one = [1e-3 + n / beta for n in sizes]
    ahead = [min(max(n - offset, 0), cap) / beta for n in sizes]
    return [{"bytes": n, "one_s": t, "chain_s": t + d} for n, t, d in zip(sizes, one, ahead)]


@pytest.mark.parametrize("offset, cap", [(5e3, 5e4), (2e4, float("inf")), (0.0, 3e3)])
def test_the_chain_fit_recovers_what_waits_ahead_of_the_go_ahead(offset, cap):
    f = _calibrate.chain(_chain_points(offset, cap), 1.2e6)
    assert f["offset_bytes"] == pytest.approx(offset, abs=200)
    if cap < float("inf"):
        assert f["cap_bytes"] == pytest.approx(cap, rel=0.02)
    else:  # no cap within the sizes probed: any at or past the largest fits
        assert f["cap_bytes"] >= 131072 - offset - 200
    assert f["max_abs_error_s"] < 2e-4
    assert [p["predicted_delay_s"] for p in f["points"]] == pytest.approx(
        [p["delay_s"] for p in f["points"]], abs=2e-4)  # fmt: skip


@pytest.mark.parametrize("points, beta, match", [
    (_chain_points(5e3, 5e4)[:1], 1e6, "at least two"),
    (_chain_points(5e3, 5e4), 0.0, "beta_bytes_s"),
    ([{"bytes": 1, "one_s": float("nan"), "chain_s": 1.0}] * 2, 1e6, "finite"),
])  # fmt: skip
def test_the_chain_fit_refuses_what_it_cannot_fit(points, beta, match):
    with pytest.raises(ValueError, match=match):
        _calibrate.chain(points, beta)


def test_sweep_stops_where_a_collective_would_take_too_long():
    assert _calibrate.sweep_sizes(None, 1.75)[-1] == _calibrate.MAX_BYTES
    for rate in (10e6, 100e6, 1e9):
        sizes = _calibrate.sweep_sizes(rate, 1.75)
        assert len(sizes) >= 4 and sizes[0] == 1024
        assert sizes[-1] * 1.75 * 8 / rate <= _calibrate.SWEEP_SECONDS


@pytest.mark.parametrize("text, want", [("10mbit", 1e7), ("2.5gbit", 2.5e9),
                                        ("unlimited", None), ("1000kbit", None)])  # fmt: skip
def test_rates(text, want):
    if text == "1000kbit":  # 1 Mbit/s: below the lab's range
        with pytest.raises(ValueError, match="within 10mbit"):
            lab.parse_rate(text)
        return
    assert lab.parse_rate(text) == want
    assert lab.parse_rate(lab.rate_name(want)) == want


@pytest.mark.parametrize("text", ["100", "fast", "20gbit", "-5mbit"])
def test_bad_rates_name_the_problem(text):
    with pytest.raises(ValueError, match="rate must"):
        lab.parse_rate(text)
