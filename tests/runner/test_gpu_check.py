"""scripts/gpu_check.py's parts that need no GPU: the in-sample step-time fit it adds for issue 17
(item 5) and its record file, written after every point so a device lost mid-check keeps what ran."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(n: int) -> list[dict]:
    frame = pd.read_parquet(ROOT / "results" / "cpu_study" / "dataset.parquet")
    ok = frame[(frame["status"] == "ok") & (frame["model_name"] == "tiny")].sort_values("config_id")
    return ok.head(n).to_dict("records")


def test_step_time_fit_keeps_one_device_and_predicts_every_point(capsys):
    gc = _gpu_check()
    rows = _rows(6)
    # a point run as an emulated card carries another preset: it must not enter the fit
    other = {**rows[0], "config_id": "emulated", "device_name": "a100_40gb", "device_peak_tflops": 312.0}
    fit = gc.step_time_fit([*rows, other])
    assert [p["point"] for p in fit["points"]] == sorted(r["config_id"] for r in rows)
    measured = {r["config_id"]: r["step_time_s"] for r in rows}
    assert all(p["measured_s"] == measured[p["point"]] and p["predicted_s"] > 0 for p in fit["points"])
    assert all(c >= 0 for c in fit["coefficients"].values())
    assert "fit (in sample, 6 points on cpu)" in capsys.readouterr().out
    assert gc.step_time_fit(rows[:2]) is None  # too few points to fit anything


def test_records_file_is_rewritten_whole_after_each_point(tmp_path):
    gc = _gpu_check()
    path = gc.write(tmp_path / "out", [{"check_name": "a"}])
    assert json.loads(path.read_text()) == {"records": [{"check_name": "a"}], "step_time_fit": None}
    gc.write(tmp_path / "out", [{"check_name": "a"}, {"check_name": "b"}], {"points": []})
    data = json.loads(path.read_text())
    assert [r["check_name"] for r in data["records"]] == ["a", "b"] and data["step_time_fit"] == {
        "points": []
    }
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpu_check.json"]  # no temporary left
