"""The study's state plot tells every run apart (it drew the AB study's 4 runs in one colour)."""

from jaxcomp.study import _plots
from jaxcomp.study import _report


def test_state_plot_draws_each_run_in_its_own_colour_and_style(tmp_path, monkeypatch):
    runs = [
        _report.Run(f"ab__optimizer={opt}__seed{seed}", "ab", {"optimizer": opt}, seed, "done",
                    {}, [], [{"step": s, "phase": s % 2, "wire_bytes": 1.0} for s in (1, 2)], {})
        for opt in ("adam", "sgdm") for seed in (0, 1)
    ]  # fmt: skip
    figures = []
    monkeypatch.setattr(_plots, "_save", lambda fig, path: figures.append(fig) or path)
    assert _plots.plot_state(runs, str(tmp_path / "state.png"))
    lines = figures[0].axes[0].get_lines()
    assert len(lines) == 4
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 4
    assert len({line.get_color() for line in lines}) == 2  # one per optimizer, seeds by style
