"""Calibration: the regressor recovers known coefficients, follows scikit-learn's conventions, and its
profiles round-trip and are refused when stale; the commands that use them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import harness_cli, spec
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from harness.analysis.calibrate import MIB, MemoryCalibrator, evaluate, profile_of, save_profile
from harness.analysis.profile import PROFILE_VERSION, CalibrationError, load_profile, peak_terms
from harness.estimate import TERMS, estimate
from harness.sweep.store import load_results

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results_small"


def synthetic(n: int, true: dict[str, float], constant_bytes: float, noise: float, seed: int = 0):
    """n runs whose terms are independent random sizes (1-200 MiB) and whose peak is the known linear
    combination, times (1 + N(0, noise))."""
    rng = np.random.default_rng(seed)
    X = pd.DataFrame({t: rng.uniform(1, 200, n) * MIB for t in TERMS})
    X["param_copies"] = 0.0  # a term absent from every run: must stay at 1
    coef = np.array([true.get(t, 1.0) for t in TERMS])
    y = (X.to_numpy() @ coef + constant_bytes) * (1 + rng.normal(0, noise, n))
    return X, y


def test_recovers_known_coefficients_from_noisy_runs():
    true = {"activations": 1.3, "logits": 2.0, "loss": 0.5, "pp_p2p": 3.0}
    X, y = synthetic(2000, true, constant_bytes=40 * MIB, noise=0.01)
    # alpha ~ 0: the prior towards 1 is a deliberate bias (see MemoryCalibrator), tested below
    model = MemoryCalibrator(alpha=1e-7).fit(X, y)
    got = dict(zip(TERMS, model.coef_, strict=True))
    for term in TERMS:
        assert got[term] == pytest.approx(true.get(term, 1.0), abs=0.05), term
    assert model.constant_bytes_ == pytest.approx(40 * MIB, rel=0.15)
    assert model.unfitted_ == ("param_copies",) and got["param_copies"] == 1.0
    # on new runs from the same law, the error is the noise
    X2, y2 = synthetic(200, true, constant_bytes=40 * MIB, noise=0.01, seed=1)
    assert np.median(np.abs(model.predict(X2) / y2 - 1)) < 0.015


def test_prior_settles_terms_the_data_cannot_tell_apart():
    """token_ids and activations that always grow together: without the prior any split fits; with it,
    the fit stays at the estimator's 1 + 1 instead of e.g. 2 + 0."""
    X, y = synthetic(300, {}, constant_bytes=0, noise=0.002)
    X["token_ids"] = X["activations"] * 0.1
    y = X.to_numpy() @ np.ones(len(TERMS))
    model = MemoryCalibrator().fit(X, y)
    got = dict(zip(TERMS, model.coef_, strict=True))
    assert got["token_ids"] == pytest.approx(1, abs=0.02) and got["activations"] == pytest.approx(1, abs=0.02)


def test_coefficients_are_never_negative():
    """A law with a term that does not matter (coefficient 0) and noise: the fit may reach 0, never less."""
    X, y = synthetic(300, {"optimizer_step": 0.0, "pp_p2p": 0.0}, constant_bytes=0, noise=0.05)
    model = MemoryCalibrator(alpha=0).fit(X, y)
    assert (model.coef_ >= 0).all() and model.constant_bytes_ >= 0


def test_follows_scikit_learn_conventions():
    est = MemoryCalibrator(alpha=1e-3, relative=False)
    assert est.get_params() == {"alpha": 1e-3, "constant": True, "features": TERMS, "relative": False}
    assert clone(est).get_params() == est.get_params()
    with pytest.raises(NotFittedError):
        est.predict(np.zeros((1, len(TERMS))))
    X, y = synthetic(50, {}, constant_bytes=0, noise=0.0)
    assert est.fit(X, y) is est
    assert {"coef_", "constant_bytes_", "unfitted_", "n_fit_"} <= set(vars(est))
    assert 0.99 < est.score(X, y) <= 1.0  # RegressorMixin's R²
    with pytest.raises(CalibrationError, match="lacks feature columns"):
        est.predict(X.drop(columns=["logits"]))


def test_peak_terms_keep_the_branch_in_the_peak():
    terms = dict.fromkeys(TERMS, 0) | {"params": 10, "activations": 5, "optimizer_step": 7}
    assert sum(peak_terms(terms).values()) == 17  # states + max(5, 7)
    assert peak_terms(terms)["activations"] == 0
    terms["logits"] = 3  # forward/backward now 8 > 7
    assert peak_terms(terms)["optimizer_step"] == 0 and sum(peak_terms(terms).values()) == 18


@pytest.fixture(scope="module")
def evaluation():
    frame, bad = load_results(FIXTURE)
    assert not bad
    return evaluate(frame)


def test_evaluation_of_the_fixture(evaluation):
    ev = evaluation
    assert set(ev.metrics) == {"paper", "megatron", "torch", "calibrated"}
    n = ev.data.measured.sum()
    assert n >= 30 and ev.data.oom.any()
    # held-out: every fold's model differs from the final one (a fold that saw everything would not)
    assert all(not np.allclose(c, ev.model.coef_) for c in ev.fold_coefs)
    # on held-out runs the calibrated estimator beats the paper's and megatron's closed forms by far
    cal = ev.metrics["calibrated"]["median_ape"]
    assert all(cal < ev.metrics[k]["median_ape"] / 2 for k in ("paper", "megatron"))
    # the safe threshold is the smallest utilisation of a run that ran out of memory, by definition
    util = ev.predictions["torch"] / ev.data.capacity
    assert ev.metrics["torch"]["safe_threshold"] == pytest.approx(util[ev.data.oom].min())


def test_profile_round_trips_and_applies(evaluation, tmp_path):
    path = save_profile(profile_of(evaluation, results_dir="fixture"), tmp_path / "p.json")
    profile = load_profile(path)
    s = spec("tiny", parallel_dp=2, train_seq_len=512, train_micro_batch_size=4, train_precision="fp32")
    est = estimate(s, engine="torch")
    expected = evaluation.model.predict(pd.DataFrame([peak_terms(est.worst.terms)]))[0]
    assert profile.total_bytes(est) == pytest.approx(expected, rel=1e-5)  # one stage: the same number
    saved = json.loads(path.read_text())
    assert saved["fitted_on"]["count"] == int(evaluation.data.measured.sum())
    assert len(saved["fitted_on"]["config_ids"]) == saved["fitted_on"]["count"]
    with pytest.raises(CalibrationError, match="engine=torch"):
        profile.total_bytes(estimate(s, engine="megatron"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=PROFILE_VERSION - 1), "has version"),
        (lambda d: d["coefficients"].update(old_term=1.0), "other feature names"),
        (lambda d: d["coefficients"].pop("logits"), "other feature names"),
        (lambda d: d.update(format="something"), "not a harness calibration profile"),
        (lambda d: d["coefficients"].update(logits=-1.0), "not finite numbers >= 0"),
    ],
)
def test_stale_or_foreign_profile_is_refused(evaluation, tmp_path, change, message):
    data = profile_of(evaluation, results_dir="fixture")
    change(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=message):
        load_profile(path)
    bad = harness_cli("estimate", f"calibration={path}")
    assert bad.returncode == 2 and message.split()[0] in bad.stderr and "Traceback" not in bad.stderr


def test_cli_calibrate_estimate_plan_and_report(tmp_path):
    profile = tmp_path / "cal.json"
    res = harness_cli("calibrate", f"results_dir={FIXTURE}", f"calibrate.profile={profile}", "format=json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out["estimators"]) == {"paper", "megatron", "torch", "calibrated"}
    assert set(out["estimators"]["calibrated"]) >= {
        "median_ape",
        "p95_ape",
        "max_under_prediction",
        "safe_threshold",
    }
    assert out["profile"] == str(profile) and profile.exists()
    # The step-time model's held-out figures (issue 17), and its section in the same profile.
    assert set(out["throughput"]) == {"median_ape", "spearman_median", "top1_ratio_median"}
    assert 0 < out["throughput"]["top1_ratio_median"] <= 1
    section = json.loads(profile.read_text())["step_time"]
    assert section["device"] == "cpu" and len(section["summary"]) == len(section["coefficients"]) + 1

    args = ["model=tiny", "train.precision=fp32", "train.seq_len=512", "parallel.dp=2"]
    plain = json.loads(harness_cli("estimate", *args, "format=json").stdout)
    cal = json.loads(harness_cli("estimate", *args, f"calibration={profile}", "format=json").stdout)
    assert (
        cal["total_bytes"] == plain["total_bytes"] and cal["calibrated_total_bytes"] != plain["total_bytes"]
    )
    assert cal["fits"] == (cal["calibrated_utilisation"] <= 0.8)
    table = harness_cli("estimate", *args, f"calibration={profile}").stdout
    assert "calibrated (" in table and "profile:" in table

    plan = json.loads(harness_cli("plan", "plan.gpus=4", f"calibration={profile}", "format=json").stdout)
    assert plan["layouts"] and all(r["calibrated_bytes"] is not None for r in plan["layouts"])
    assert all(r["utilisation"] <= 0.8 for r in plan["layouts"])
    times = [r["predicted_step_time_s"] for r in plan["layouts"]]  # ranked by the fitted step time
    assert None not in times and times == sorted(times)

    out_dir = tmp_path / "report"
    for _ in range(2):  # regenerated from the same runs: the same file, byte for byte
        res = harness_cli("report", f"results_dir={FIXTURE}", f"report.out={out_dir}")
        assert res.returncode == 0, res.stderr
        text = (out_dir / "report.md").read_text()
        first = locals().setdefault("first", text)
    assert text == first
    names = ("predicted_vs_measured", "utilisation_vs_outcome", "residuals_by_term", "throughput_tp_pp")
    for name in (*names, "fastest_layout"):
        assert (out_dir / "figures" / f"{name}.png").stat().st_size > 10_000
        assert f"figures/{name}.png" in text
    assert "| calibrated |" in text and "The calibrated held-out median error" in text
    assert "## Which layout is fastest: predicted vs measured" in text


def test_calibrate_says_what_is_wrong_with_its_input(tmp_path):
    res = harness_cli("calibrate", f"results_dir={tmp_path / 'none'}")
    assert res.returncode == 2 and "is not a directory" in res.stderr
    res = harness_cli("calibrate", f"results_dir={FIXTURE}", "calibrate.group_by=node")
    assert res.returncode == 2 and "group_by='node' must be one of" in res.stderr


def test_fake_out_of_memory_rows_keep_their_whole_peak():
    # A fake run that exceeds the device completes its trace (harness/runner/fake), as a simulated
    # CPU OOM completes its step: both peaks are whole and are fitted; a real CUDA OOM's is not.
    from harness.analysis.calibrate import prepare

    frame, _ = load_results(FIXTURE)
    frame = frame[frame["status"] == "oom"].head(3).copy()
    frame["peak_allocated_bytes"] = 1e9
    frame["oom_source"] = ["fake", "simulated", "cuda"]
    assert prepare(frame).measured.tolist() == [True, True, False]


def test_layout_label_tells_the_recomputation_methods_apart():
    """Every 2nd block, Megatron's uniform groups of 2 and its first 2 blocks are different layouts
    (different memory): the report's label must not print them alike."""
    import pandas as pd

    from harness.analysis.report import layout_label

    base = {
        "parallel_dp": 1,
        "parallel_tp": 1,
        "parallel_pp": 1,
        "parallel_cp": 1,
        "parallel_zero_stage": 0,
        "parallel_sequence_parallel": False,
        "train_micro_batch_size": 1,
        "train_recompute": "full",
        "train_recompute_every": 2,
    }
    labels = {
        method: layout_label(pd.Series({**base, "train_recompute_method": method}))
        for method in ("every", "uniform", "block")
    }
    assert labels["every"].endswith("rc=full/2")
    assert labels["uniform"].endswith("rc=full/uniform2") and labels["block"].endswith("rc=full/block2")
    assert layout_label(pd.Series({**base, "train_recompute_every": 1})).endswith("rc=full")


def test_report_of_runs_without_timing_fields(tmp_path):
    """Fake runs record no timing fields at all: the report says so instead of failing on the missing
    throughput column (it did, on the paper fake studies)."""
    from harness.analysis.report import write_report

    frame = pd.read_parquet(FIXTURE / "dataset.parquet")
    timing = [c for c in frame.columns if c.startswith(("tflops", "step_time", "tokens_per", "mfu"))]
    path = write_report(frame.drop(columns=timing), out_dir=tmp_path, results_dir="fixture", engine="torch")
    text = path.read_text()
    assert "No run has a throughput figure (fake runs time nothing)." in text
    assert not (tmp_path / "figures" / "throughput_tp_pp.png").exists()
    assert (tmp_path / "figures" / "predicted_vs_measured.png").exists()
