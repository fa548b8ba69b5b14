"""The analysis notebook (jupytext percent format, valid Python) runs end to end on the committed fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_analysis_notebook_runs_on_the_fixture(tmp_path):
    env = dict(
        os.environ,
        HARNESS_RESULTS_DIR=str(ROOT / "tests" / "fixtures" / "results_small"),
        HARNESS_NOTEBOOK_OUT=str(tmp_path),
        MPLBACKEND="Agg",
    )
    res = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "analysis.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "unreadable files: none" in res.stdout and "calibrated:" in res.stdout
    for name in ("predicted_vs_measured", "utilisation_vs_outcome", "residuals_by_term", "throughput_tp_pp"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
    header = (ROOT / "notebooks" / "analysis.py").read_text().split("# ---", 2)[1]
    assert "format_name: percent" in header  # the jupytext header: jupytext opens it as a notebook
