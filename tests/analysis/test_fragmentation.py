"""The fitted fragmentation term: recovered from runs whose reserved peak follows a known law, judged held
out at the reserved level, stored in the profile and applied by it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.analysis.calibrate import evaluate, prepare, profile_of, save_profile
from harness.analysis.fragmentation import FragmentationModel, features, reserved_target
from harness.analysis.profile import load_profile
from harness.estimate import estimate
from harness.spec import from_flat

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results_small" / "dataset.parquet"
MIB = 2**20


@pytest.fixture(scope="module")
def frame_with_reserved() -> pd.DataFrame:
    """The fixture's runs with a replayed reserved peak made by a known law: reserved = allocated +
    0.25 x transient + 2 MiB, transient being the torch estimate's peak minus its model states."""
    frame = pd.read_parquet(FIXTURE)
    data = prepare(frame)
    X = features(data.terms["torch"])
    out = data.frame.copy()
    out["sim_peak_reserved_bytes"] = out["peak_allocated_bytes"] + 0.25 * X["transient"] + 2 * MIB
    return out


def test_the_law_is_recovered_and_judged_held_out(frame_with_reserved, tmp_path):
    ev = evaluate(frame_with_reserved, engine="torch", group_by="world")
    f = ev.fragmentation
    assert f["target"] == "sim_peak_reserved_bytes"
    assert f["per_transient_byte"] == pytest.approx(0.25, abs=1e-3)
    assert f["per_state_byte"] == pytest.approx(0.0, abs=1e-3)
    assert f["constant_bytes"] == pytest.approx(2 * MIB, rel=1e-2)
    # The reserved level's held-out error is the allocated fit's (the law itself is exact): it cannot
    # be far above the calibrated allocated median.
    h = f["held_out"]
    assert h["runs"] == int(ev.data.measured.sum())
    assert h["median_ape"] <= ev.metrics["calibrated"]["median_ape"] + 0.01
    # Stored in the profile and applied to an estimate: allocated + 0.25 x transient + 2 MiB.
    path = save_profile(profile_of(ev, results_dir="fixture"), tmp_path / "p.json")
    profile = load_profile(path)
    spec = from_flat(frame_with_reserved.iloc[0].to_dict())
    est = estimate(spec, engine="torch")
    allocated = profile.total_bytes(est)
    reserved = profile.reserved_bytes(est)
    assert reserved > allocated
    stage = max(est.stages, key=lambda s: profile.stage_bytes(s.terms))
    assert reserved >= profile.stage_bytes(stage.terms) + 2 * MIB - 1


def test_no_reserved_peak_no_fit():
    frame = pd.read_parquet(FIXTURE)
    assert reserved_target(frame)[1] is None
    assert evaluate(frame, engine="torch").fragmentation is None


def test_cuda_measurements_take_precedence_over_replays():
    frame = pd.DataFrame({"peak_reserved_bytes": [np.nan, 5.0], "sim_peak_reserved_bytes": [3.0, 4.0]})
    values, column = reserved_target(frame)
    assert column == "peak_reserved_bytes" and np.isnan(values[0]) and values[1] == 5.0


def test_the_model_never_subtracts_memory():
    # Less reserved than allocated (impossible, but noisy data) must not give a negative constant.
    X = pd.DataFrame({"transient": [1e6, 2e6, 3e6, 4e6], "states": [1e6] * 4})
    m = FragmentationModel().fit(X, [-5e5, -4e5, -3e5, -2e5])
    assert m.constant_bytes_ >= 0 and (m.coef_ >= 0).all()


def test_calibrate_prints_the_fragmentation_fit(frame_with_reserved):
    """``harness calibrate``'s table names the fitted law and its held-out figures at the reserved level
    (they were only in calibration.json and report.md); without reserved peaks it says it is not fitted."""
    from harness.cli.render.calibrate import calibration_table

    ev = evaluate(frame_with_reserved, engine="torch", group_by="world")
    table = calibration_table(ev, profile_path="p.json")
    line = next(ln for ln in table.splitlines() if ln.startswith("fragmentation ("))
    assert "sim_peak_reserved_bytes" in line and ev.fragmentation["summary"] in line
    held = f"median APE {ev.fragmentation['held_out']['median_ape']:.1%}"
    assert held in table.split(line, 1)[1]
    plain = calibration_table(evaluate(pd.read_parquet(FIXTURE), engine="torch"), profile_path="p.json")
    assert "fragmentation: not fitted" in plain
