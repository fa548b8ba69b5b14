"""The figures' axes say what issue 16 asked of them (drawn from the committed small fixture)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.analysis import plots
from harness.analysis.calibrate import MIB, evaluate
from harness.sweep.store import load_results

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results_small"


@pytest.fixture(scope="module")
def drawn():
    """Every figure of the fixture's study, kept open instead of saved."""
    frame, _ = load_results(FIXTURE)
    ev = evaluate(frame, engine="torch", group_by="world")
    figures = {}
    original = plots._save
    plots._save = lambda fig, out_dir, name: figures.setdefault(name, fig) and []
    try:
        plots.all_figures(ev, frame, "unused")
    finally:
        plots._save = original
    return ev, frame, figures


def test_predicted_vs_measured_has_the_capacity_and_says_what_is_in_sample(drawn):
    ev, _, figures = drawn
    fig = figures["predicted_vs_measured"]
    capacity_mib = float(np.unique(ev.data.capacity)[0]) / MIB  # the fixture's runs: 256 MiB each
    assert capacity_mib == 256
    for ax in fig.axes:
        xs = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"]
        assert capacity_mib in xs
    titles = [ax.get_title() for ax in fig.axes]
    assert sum("nothing fitted" in t for t in titles) == 3
    assert sum("out-of-sample: held out by world" in t for t in titles) == 1
    assert "no panel is in-sample" in fig._suptitle.get_text()


def test_utilisation_axis_is_linear_over_where_decisions_are_made(drawn):
    ev, _, figures = drawn
    for ax, name in zip(figures["utilisation_vs_outcome"].axes, plots.ESTIMATORS, strict=False):
        assert ax.get_xscale() == "linear" and ax.get_xlim() == (0.5, 1.3)
        util = ev.predictions[name] / ev.data.capacity
        assert f"{int((util < 0.5).sum())} runs below 50%" in ax.get_title(loc="left")


def test_coefficients_axis_is_centred_on_one(drawn):
    _, _, figures = drawn
    left = figures["residuals_by_term"].axes[0]
    lo, hi = left.get_xlim()
    assert left.get_xscale() == "linear" and (lo + hi) / 2 == pytest.approx(1.0)
    assert all(bar.get_x() == 1.0 for bar in left.patches)  # bars grow from 1, not from 0


def test_throughput_heatmap_has_a_colour_scale_per_panel(drawn):
    _, _, figures = drawn
    panels = [ax for ax in figures["throughput_tp_pp"].axes if ax.images]
    limits = [ax.images[0].get_clim() for ax in panels]
    assert len(set(limits)) == len(panels) > 1
    for ax, (vmin, vmax) in zip(panels, limits, strict=True):
        values = ax.images[0].get_array().compressed()  # this panel's own best values
        assert (vmin, vmax) == (values.min(), values.max()) or len(set(values)) == 1
