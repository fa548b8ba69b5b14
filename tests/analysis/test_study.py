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


BF16 = ROOT / "results" / "cpu_study_bf16"


@pytest.mark.skipif(not (BF16 / "dataset.parquet").exists(), reason="no committed BF16 study")
def test_bf16_study_judges_every_stage_and_every_zero1_partition():
    """Issue 30 item 3 on the BF16 study: every pipeline stage against its own estimate and every rank
    of a ZeRO-1 run against its own partition's, raw and calibrated held out (the profile's
    ``per_rank``); item 4's goal of 95 % of the stages within 2 % under holds (78.8 % before the
    per-stage mechanisms). The one stage beyond 5 % is named in docs/studies/cpu_study_bf16.md."""
    from harness.analysis.calibrate import evaluate
    from harness.sweep.store import load_results

    frame, _ = load_results(str(BF16))
    per_rank = evaluate(frame).stage_metrics
    stages, partitions = per_rank["stages"], per_rank["partitions"]
    assert stages["raw"]["stages"] == 80 and stages["raw"]["within_2pct_under"] >= 0.95
    assert stages["calibrated"]["stages"] == 80
    assert partitions["raw"]["stages"] == 44 and partitions["raw"]["within_2pct_under"] == 1.0
    profile = json.loads((BF16 / "calibration.json").read_text())
    assert profile["per_rank"]["stages"]["raw"]["within_2pct_under"] == stages["raw"]["within_2pct_under"]
