"""Calibration profiles: every field checked with a one-line error (issue 12), unknown well-formed
sections tolerated, applied without scikit-learn, a warning outside what the fit saw and the learned
safe threshold on request (issue 16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import harness_cli, spec

from harness.analysis.profile import PROFILE_FORMAT, PROFILE_VERSION, CalibrationError, load_profile
from harness.estimate import TERMS, estimate

ROOT = Path(__file__).resolve().parents[2]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results_small"


def profile_data(**changes) -> dict:
    """A well-formed profile: every coefficient 1.0, a 1 MiB constant, fitted on CPU FP32 runs of
    the tiny to medium models (1.79 M - 25.6 M parameters), safe below 0.5."""
    data = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "harness_version": "0.1.0",
        "engine": "torch",
        "target": "peak_allocated_bytes",
        "features": list(TERMS),
        "coefficients": {t: 1.0 for t in TERMS},
        "unfitted": [],
        "constant_bytes": 2**20,
        "fragmentation": None,
        "summary": "every term x 1.000 + 1.0 MiB",
        "fitted_on": {
            "results_dir": "r",
            "count": 3,
            "config_ids": ["a", "b", "c"],
            "device_kinds": ["cpu"],
            "precisions": ["fp32"],
            "model_params": [1787008, 25565568],
            "torch_versions": ["2.13.0"],
        },
        "cross_validation": {"group_by": "world", "folds": 2},
        "metrics": {"calibrated": {"safe_threshold": 0.5}},
    }
    data.update(changes)
    return data


def write(tmp_path, data, text: str | None = None, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(text if text is not None else json.dumps(data))
    return path


def test_a_well_formed_profile_applies_as_its_coefficients_say(tmp_path):
    profile = load_profile(write(tmp_path, profile_data()))
    est = estimate(spec("tiny", train_precision="fp32"), engine="torch")
    # every coefficient 1: the estimate itself, plus the 1 MiB constant
    assert profile.total_bytes(est) == est.total_bytes + 2**20
    assert profile.safe_threshold == 0.5


COEFS = {t: 1.0 for t in TERMS}


@pytest.mark.parametrize(
    "changes, message",
    [
        # before issue 12 a negative constant gave a "fits" verdict at -9e20 GiB
        ({"constant_bytes": -1e30}, "constant_bytes = -1e+30 must be a finite number in [0, "),
        ({"constant_bytes": [1]}, "constant_bytes = [1] must be a number"),
        ({"constant_bytes": True}, "constant_bytes = True must be a number"),
        (
            {"coefficients": {**COEFS, "logits": 1e308}},
            "coefficients.logits = 1e+308 must be a finite number in [0, 100]",
        ),
        (
            {"coefficients": {**COEFS, "logits": [1.0]}},
            "coefficients of ['logits'] are not finite numbers >= 0",
        ),
        ({"fragmentation": "lots"}, "fragmentation = 'lots' must be an object (or null)"),
        (
            {"fragmentation": {"per_allocated_byte": 0.1}},
            "fragmentation.constant_bytes = None must be a number",
        ),
        (
            {"fragmentation": {"per_allocated_byte": -2, "constant_bytes": 0}},
            "fragmentation.per_allocated_byte",
        ),
        (
            {"metrics": {"calibrated": {"safe_threshold": "high"}}},
            "metrics.calibrated.safe_threshold = 'high'",
        ),
        (
            {"fitted_on": {"model_params": [5, 1]}},
            "fitted_on.model_params[1] = 1 must be a finite number in [5, ",
        ),
        ({"fitted_on": {"device_kinds": "cpu"}}, "fitted_on.device_kinds = 'cpu' must be a list of strings"),
        ({"summary": 3}, "summary = 3 must be text"),
    ],
)
def test_every_field_is_checked_in_one_line(tmp_path, changes, message):
    with pytest.raises(CalibrationError) as err:
        load_profile(write(tmp_path, profile_data(**changes)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_non_finite_json_and_cli_errors_are_one_line(tmp_path):
    text = json.dumps(profile_data()).replace('"constant_bytes": 1048576', '"constant_bytes": NaN')
    with pytest.raises(CalibrationError, match="not readable JSON: NaN is not a finite number"):
        load_profile(write(tmp_path, None, text))
    path = write(tmp_path, profile_data(constant_bytes=-9e20))
    r = harness_cli("estimate", f"calibration={path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "constant_bytes = -9e+20" in r.stderr


def test_unknown_well_formed_sections_are_kept_not_refused(tmp_path):
    # a newer fit's sections (a step-time model, a richer fragmentation term) load; what is known is
    # still checked
    data = profile_data(
        step_time={"coefficients": {"compute": 1.1}, "constant_s": 0.01},
        fragmentation={"per_allocated_byte": 0.05, "constant_bytes": 0, "segments": {"small": 2}},
    )
    profile = load_profile(write(tmp_path, data))
    assert profile.extra == {"step_time": {"coefficients": {"compute": 1.1}, "constant_s": 0.01}}
    assert profile.fragmentation["segments"] == {"small": 2}


def test_applied_outside_what_it_was_fitted_on_it_says_so(tmp_path):
    profile = load_profile(write(tmp_path, profile_data()))
    assert profile.outside(spec("small", train_precision="fp32")) is None  # 10.0 M: inside
    line = profile.outside(spec("llama3_70b", "h100_80gb", train_precision="bf16"))
    assert line == (
        f"calibration {tmp_path / 'p.json'} is applied outside what it was fitted on: device h100_80gb "
        "(fitted on cpu); precision bf16 (fitted on fp32); 70.6 B parameters (fitted on 1.79 M–25.6 M)"
    )
    # profiles written before they recorded their range: nothing to say
    old = load_profile(
        write(tmp_path, profile_data(fitted_on={"results_dir": "r", "count": 0}), name="old.json")
    )
    assert old.outside(spec("llama3_70b", "h100_80gb")) is None
    # (device= and train= named: no GPU-scale defaults note beside the warning)
    r = harness_cli(
        "estimate",
        "model=llama3_70b",
        "device=h100_80gb",
        "train=paper",
        f"calibration={tmp_path / 'p.json'}",
    )
    assert r.returncode == 0 and r.stderr.startswith("harness: warning: calibration "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_threshold_profile_uses_the_learned_safe_threshold(tmp_path):
    path = write(tmp_path, profile_data())
    r = harness_cli(
        "estimate", "train.precision=fp32", f"calibration={path}", "threshold=profile", "format=json"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["threshold"] == 0.5
    r = harness_cli("estimate", "threshold=profile")
    assert r.returncode == 2 and "threshold=profile needs calibration=PATH" in r.stderr
    none = write(tmp_path, profile_data(metrics={"calibrated": {"safe_threshold": None}}))
    r = harness_cli("estimate", f"calibration={none}", "threshold=profile")
    assert r.returncode == 2 and "learned no safe threshold" in r.stderr


def test_applying_a_profile_imports_no_scikit_learn(tmp_path):
    path = write(tmp_path, profile_data())
    code = (
        "import sys; from harness.cli.main import main; "
        f"main(['estimate', 'train.precision=fp32', 'calibration={path}']); "
        "print('sklearn' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"


def test_calibrate_records_what_the_profile_was_fitted_on(tmp_path):
    profile = tmp_path / "cal.json"
    r = harness_cli("calibrate", f"results_dir={FIXTURE}", f"calibrate.profile={profile}", "format=json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(profile.read_text())["fitted_on"]
    assert seen["device_kinds"] == ["cpu"] and seen["precisions"] == ["fp32"]
    low, high = seen["model_params"]
    assert 0 < low <= high and seen["torch_versions"]
    assert load_profile(profile).outside(spec("llama3_70b", "h100_80gb")) is not None


def test_a_profile_fitted_over_the_mechanism_terms_adds_them_on_every_stage():
    # Issue 32: the paper-scale profile's fragmentation comes on top of the estimator's mechanism terms;
    # its reserved level is the max over stages of allocated + mechanism + fitted fragmentation, which the
    # bounded search (only the stages that can be the worst get their mechanism terms) must equal.
    from harness.estimate.levels import mechanism_bytes

    profile = load_profile(ROOT / "results/paper_fake/h100_94gb/calibration.json")
    assert profile.fragmentation["over_mechanism"] is True
    for overrides in (
        {"parallel_dp": 2, "parallel_tp": 2, "parallel_pp": 2},
        {"parallel_tp": 2, "parallel_pp": 4, "parallel_dp": 2},
        {"parallel_dp": 8, "parallel_zero_stage": 3},
    ):
        s = spec("llama2_13b", "h100_94gb", train_precision="bf16", train_seq_len=4096, **overrides)
        est = estimate(s)
        every = max(profile.stage_reserved_bytes(st.terms, mechanism_bytes(est, st)) for st in est.stages)
        assert profile.reserved_bytes(est) == round(every)
        without = max(profile.stage_reserved_bytes(st.terms) for st in est.stages)
        assert profile.reserved_bytes(est) >= without
