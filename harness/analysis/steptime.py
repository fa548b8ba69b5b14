"""Step-time calibration: fit the step-time model's named terms (harness/estimate/steptime.py) on timed
runs, held out by world size, and judge how well it ranks layouts (Spearman, top-1 ratio).

No torch here; scikit-learn for the regression and the grouped folds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted

from harness.analysis.calibrate import GROUPINGS, group_of
from harness.analysis.profile import CalibrationError
from harness.estimate.steptime import TERMS as STEP_TIME_TERMS
from harness.estimate.steptime import StepTimeModel
from harness.estimate.steptime import terms_of as step_terms_of
from harness.spec import from_flat


class StepTimeCalibrator(RegressorMixin, BaseEstimator):
    """``step_time_s ~ sum_k coef_k * term_k + constant``, all >= 0: the step-time model's named terms
    (harness/estimate/steptime.py) fitted on measured step times, on the relative error (each run
    weighted by 1/measured^2) like the memory fit, so that a 30 ms and a 3 s step count alike. A term
    that is zero in every training run (no pipeline in the sweep) keeps coefficient 0 and is listed
    in ``unfitted_``: the sweep says nothing about it."""

    def __init__(self, features: tuple[str, ...] = STEP_TIME_TERMS, *, constant: bool = True):
        self.features = features
        self.constant = constant

    def fit(self, X, y) -> StepTimeCalibrator:
        A = np.asarray(X[list(self.features)] if isinstance(X, pd.DataFrame) else X, dtype=float)
        y = np.asarray(y, dtype=float)
        if len(y) == 0:
            raise CalibrationError("no measured step times to fit")
        fitted = np.abs(A).sum(axis=0) > 0
        self.unfitted_ = tuple(f for f, ok in zip(self.features, fitted, strict=True) if not ok)
        # Each column scaled to unit mean so that the solver sees comparable columns.
        scale = np.where(fitted, np.abs(A).mean(axis=0), 1.0)
        design = A[:, fitted] / scale[fitted]
        if self.constant:
            design = np.column_stack([design, np.full(len(y), y.mean())])
        reg = LinearRegression(fit_intercept=False, positive=True)
        reg.fit(design, y, sample_weight=1.0 / np.maximum(y, 1e-9) ** 2)
        coef = np.zeros(len(self.features))
        k = int(fitted.sum())
        coef[fitted] = reg.coef_[:k] / scale[fitted]
        self.coef_ = coef
        self.constant_s_ = float(reg.coef_[-1] * y.mean()) if self.constant else 0.0
        self.n_fit_ = len(y)
        return self

    def predict(self, X) -> np.ndarray:
        check_is_fitted(self, "coef_")
        A = np.asarray(X[list(self.features)] if isinstance(X, pd.DataFrame) else X, dtype=float)
        return A @ self.coef_ + self.constant_s_

    def model(
        self, device: str, *, cpu_cores: int | None = None, precisions: tuple[str, ...] = ()
    ) -> StepTimeModel:
        check_is_fitted(self, "coef_")
        coefs = {f: float(c) for f, c in zip(self.features, self.coef_, strict=True)}
        return StepTimeModel(coefs, self.constant_s_, device, cpu_cores, self.unfitted_, precisions)


@dataclass
class StepTimeEvaluation:
    """Held-out step-time predictions (each by a fit that never saw the run's group), their accuracy
    and ranking quality, and the model fitted on every timed run (the profile's ``step_time``)."""

    frame: pd.DataFrame  # the timed runs, with measured and held-out predicted step time and throughput
    group_by: str
    metrics: dict[str, Any]
    model: StepTimeModel
    fold_coefs: np.ndarray


def step_time_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs with a measured step time on one device: ok runs, and simulated out-of-memory runs (on the
    CPU the step completes and is timed). The spec is rebuilt from the columns and the terms computed
    (so an improved model needs no rerun)."""
    if "step_time_s" not in frame:
        return pd.DataFrame()
    simulated = frame.get("oom_source", pd.Series(None, index=frame.index)) == "simulated"
    keep = ((frame["status"] == "ok") | simulated) & (frame["step_time_s"] > 0)
    runs = frame[keep.fillna(False)].copy()
    if "config_id" in runs:
        runs = runs.sort_values("config_id", kind="stable")
    runs = runs.reset_index(drop=True)
    rows = runs.to_dict("records")
    specs = [from_flat(row) for row in rows]
    cores = [_int_or_none(row.get("env_cpu_count")) for row in rows]
    terms = pd.DataFrame(
        [step_terms_of(s, cpu_cores=c) for s, c in zip(specs, cores, strict=True)],
        columns=list(STEP_TIME_TERMS),
    )
    out = pd.concat([runs, terms.add_prefix("st_")], axis=1)
    out["st_world"] = [s.parallel.world for s in specs]
    out["st_model"] = [s.model.name for s in specs]
    out["st_device"] = [s.device.name for s in specs]
    out["st_layout"] = [group_of(s, "layout") for s in specs]
    out["st_family"] = [group_of(s, "family") for s in specs]
    out["st_tokens_per_step"] = [s.global_batch_size * s.train.seq_len for s in specs]
    return out


def _int_or_none(value: Any) -> int | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def ranking(runs: pd.DataFrame, predicted: np.ndarray) -> pd.DataFrame:
    """Per (model, world size) group of at least 3 runs: the Spearman correlation of predicted and
    measured throughput (tokens/s), and the top-1 ratio, the measured throughput of the layout predicted
    fastest over the best measured one (1.0: the prediction picked the fastest)."""
    from scipy.stats import spearmanr

    f = runs.assign(
        measured_tps=runs["st_tokens_per_step"] / runs["step_time_s"],
        predicted_tps=runs["st_tokens_per_step"] / predicted,
    )
    rows = []
    for (model, world), g in f.groupby(["st_model", "st_world"], sort=True):
        if len(g) < 3:
            continue
        rho = spearmanr(g["predicted_tps"], g["measured_tps"]).statistic
        top = g.loc[g["predicted_tps"].idxmax(), "measured_tps"] / g["measured_tps"].max()
        rows.append({"model": model, "world": int(world), "runs": len(g), "spearman": rho, "top1_ratio": top})
    return pd.DataFrame(rows)


def evaluate_step_time(
    frame: pd.DataFrame, *, group_by: str = "world", without: tuple[str, ...] = ()
) -> StepTimeEvaluation | None:
    """Fit the step-time model held out by ``group_by`` (world sizes by default: each run is predicted
    by a fit that never saw its world size) and judge it; None when the results hold fewer than 5
    timed runs or one group only.

    The fit uses every timed run (ok, and simulated out-of-memory runs whose step was timed); the
    judgement, the runs that fit (status ok: the layouts ``plan`` ranks). ``median_ape``: held-out
    |predicted - measured| / measured of the step time; ``spearman_median`` and ``top1_ratio_median``:
    the medians over (model, world size) groups of :func:`ranking`'s figures. ``without``: terms left
    out of the fit (as if no run had them: an ablation, ``scripts/steptime_eval.py --without``)."""
    if group_by not in GROUPINGS:
        raise CalibrationError(f"group_by={group_by!r} must be one of {', '.join(GROUPINGS)}")
    runs = step_time_rows(frame)
    if len(runs) < 5:
        return None
    device = runs["st_device"].mode()[0]  # one profile per device: the sweep's most common one
    runs = runs[runs["st_device"] == device].reset_index(drop=True)
    column = f"st_{group_by}"
    groups = runs[column].astype(str).to_numpy()
    n_groups = len(set(groups))
    if len(runs) < 5 or n_groups < 2:
        return None
    unknown = set(without) - set(STEP_TIME_TERMS)
    if unknown:
        known = ", ".join(STEP_TIME_TERMS)
        raise CalibrationError(f"without={sorted(unknown)}: not step-time terms ({known})")
    runs = runs.assign(**{f"st_{k}": 0.0 for k in without})
    X = runs[[f"st_{k}" for k in STEP_TIME_TERMS]].to_numpy(dtype=float)
    y = runs["step_time_s"].to_numpy(dtype=float)
    held_out, coefs = np.full(len(y), np.nan), []
    for train, test in GroupKFold(n_splits=min(5, n_groups)).split(X, y, groups):
        fit = StepTimeCalibrator().fit(X[train], y[train])
        coefs.append(fit.coef_)
        held_out[test] = fit.predict(X[test])
    final = StepTimeCalibrator().fit(X, y)
    runs = runs.assign(predicted_step_time_s=held_out)
    judged = (runs["status"] == "ok").to_numpy()
    ranks = ranking(runs[judged], held_out[judged])
    ape = (np.abs(held_out - y) / y)[judged]
    metrics = {
        "fit_runs": len(y),
        "judged_runs": int(judged.sum()),
        "median_ape": float(np.median(ape)) if len(ape) else None,
        "p95_ape": float(np.percentile(ape, 95)) if len(ape) else None,
        "spearman_median": float(ranks["spearman"].median()) if len(ranks) else None,
        "top1_ratio_median": float(ranks["top1_ratio"].median()) if len(ranks) else None,
        "groups": ranks.to_dict("records"),
    }
    cores = runs["env_cpu_count"].dropna() if "env_cpu_count" in runs else pd.Series(dtype=float)
    cpu_cores = int(cores.median()) if device == "cpu" and len(cores) else None
    precisions = tuple(sorted(set(runs["train_precision"].astype(str))))
    model = final.model(device, cpu_cores=cpu_cores, precisions=precisions)
    return StepTimeEvaluation(runs, group_by, metrics, model, np.array(coefs))


def step_time_section(ev: StepTimeEvaluation) -> dict[str, Any]:
    """The profile's ``step_time`` section: one readable line per term, the coefficients, the metrics."""
    m = ev.model
    return {
        "device": m.device,
        "cpu_cores": m.cpu_cores,
        "precisions": list(m.precisions),
        "target": "step_time_s",
        "coefficients": {k: float(f"{c:.6g}") for k, c in m.coefficients.items()},
        "constant_s": float(f"{m.constant_s:.6g}"),
        "unfitted": list(m.unfitted),
        "summary": m.describe(),
        "cross_validation": {"group_by": ev.group_by, "folds": len(ev.fold_coefs)},
        "metrics": {k: v for k, v in ev.metrics.items() if k != "groups"},
        # JSON has no NaN: a group whose measured times all tie has no Spearman correlation.
        "groups": [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in g.items()}
            for g in ev.metrics["groups"]
        ],
    }
