"""The analysis notebook (jupytext percent format, valid Python) runs end to end on the committed fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_analysis_notebook_runs_on_the_fixture(tmp_path):
    env = dict(
        os.environ,
        HARNESS_RESULTS_DIR=str(ROOT / "tests" / "fixtures" / "results_small"),
        HARNESS_NOTEBOOK_OUT=str(tmp_path),
        MPLBACKEND="Agg",
    )
    res = _run_notebook(env)
    assert "unreadable files: none" in res.stdout and "calibrated:" in res.stdout
    # as a script it prints the ten worst points (a table's last expression shows only in Jupyter)
    worst = res.stdout.split("the ten largest errors of the raw torch engine")[1]
    worst = worst.split("predicted_vs_measured")[0]
    assert "torch_error" in worst and len(worst.strip().splitlines()) == 1 + 1 + 10
    for name in ("predicted_vs_measured", "utilisation_vs_outcome", "residuals_by_term", "throughput_tp_pp"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
    header = (ROOT / "notebooks" / "analysis.py").read_text().split("# ---", 2)[1]
    assert "format_name: percent" in header  # the jupytext header: jupytext opens it as a notebook


@pytest.mark.slow
def test_analysis_notebook_shows_figures_inline_under_ipython(tmp_path):
    # A stand-in IPython whose display() says what it was given: under Jupyter the notebook displays
    # its tables and each figure's PNG instead of printing them.
    fake = tmp_path / "fake" / "IPython"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(  # enough of a shell for matplotlib's REPL hook too
        "from types import SimpleNamespace\n"
        "version_info = (9, 0)\n"
        "_events = SimpleNamespace(register=lambda *a: None)\n"
        "_shell = SimpleNamespace(events=_events, enable_gui=lambda *a: None)\n"
        "def get_ipython():\n    return _shell\n"
    )
    (fake / "display.py").write_text(
        "class Image:\n    def __init__(self, filename):\n        self.filename = filename\n"
        "def display(obj):\n    print('DISPLAY', type(obj).__name__, getattr(obj, 'filename', ''))\n"
    )
    env = dict(
        os.environ,
        HARNESS_RESULTS_DIR=str(ROOT / "tests" / "fixtures" / "results_small"),
        HARNESS_NOTEBOOK_OUT=str(tmp_path / "out"),
        MPLBACKEND="Agg",
        PYTHONPATH=str(tmp_path / "fake"),
    )
    res = _run_notebook(env)
    shown = [ln for ln in res.stdout.splitlines() if ln.startswith("DISPLAY Image")]
    assert [Path(ln.split()[-1]).stem for ln in shown] == [
        "predicted_vs_measured",
        "utilisation_vs_outcome",
        "residuals_by_term",
        "throughput_tp_pp",
    ]
    assert "DISPLAY DataFrame" in res.stdout and "torch_error" not in res.stdout  # shown, not printed


def _run_notebook(env: dict) -> subprocess.CompletedProcess:
    """The notebook run as a script with ``env``; it must succeed."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "analysis.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res
