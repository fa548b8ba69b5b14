"""The committed CPU study (results/cpu_study) regenerates: its report from its dataset, byte for byte,
and its calibration profile to the same coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import harness_cli

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "results" / "cpu_study"

pytestmark = pytest.mark.skipif(not (STUDY / "dataset.parquet").exists(), reason="no committed study")


def test_report_regenerates_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the report names results_dir as given
    res = harness_cli("report", "results_dir=results/cpu_study", f"report.out={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "report.md").read_text() == (STUDY / "report.md").read_text()


def test_profile_regenerates(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "calibration.json"
    res = harness_cli("calibrate", "results_dir=results/cpu_study", f"calibrate.profile={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    new, old = json.loads(out.read_text()), json.loads((STUDY / "calibration.json").read_text())
    assert new["fitted_on"] == old["fitted_on"] and new["features"] == old["features"]
    for term, c in old["coefficients"].items():
        assert new["coefficients"][term] == pytest.approx(c, abs=1e-4), term
    assert new["metrics"]["calibrated"]["median_ape"] == pytest.approx(
        old["metrics"]["calibrated"]["median_ape"]
    )
