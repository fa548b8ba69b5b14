"""Calibration: fit correction coefficients onto the analytical estimator's named terms, cross-validated
on held-out layouts, and judge every estimator (paper, megatron, torch raw, calibrated) the same way.

The fit reads as "activations x 1.07 + logits x 1.31 + ... + 12 MiB": one non-negative coefficient per
term of the estimator's peak (ESTIMATOR.md section 4: the temporary buffers are the terms calibration is
for), plus a constant, fitted by least squares on the *relative* error (each run weighted by
1/measured^2), because users read errors as percentages and peaks span two orders of magnitude. Where
runs report a reserved peak (measured on CUDA, or replayed from a CPU run's trace), a second fit adds
the fragmentation (harness/analysis/fragmentation.py), judged held out at the reserved level.

No torch here; scikit-learn for the regression and the grouped folds.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted

from harness import __version__
from harness.analysis import fragmentation as frag
from harness.analysis.fragmentation import card_outcomes
from harness.analysis.profile import (
    ENGINES_COMPARED,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CalibrationError,
    fitted_on,
    peak_terms,
)
from harness.analysis.stages import partition_errors, stage_errors
from harness.analysis.stages import summary as stage_summary
from harness.estimate import TERMS, estimate, levels
from harness.spec import InvalidSpec, RunSpec, from_flat

ESTIMATORS = (*ENGINES_COMPARED, "calibrated")
GROUPINGS = ("world", "model", "layout", "family")
GROUP_WORDS = {  # each grouping in words, for tables
    "world": "world size",
    "model": "model",
    "layout": "tp-pp-cp layout",
    "family": "layout family (pipeline schedule, ZeRO, cp, recomputation)",
}
MIB = 2**20
PAPER_THRESHOLD = 0.8  # Fujii et al. 2024: below 80 % estimated utilisation no run ran out of memory


class MemoryCalibrator(RegressorMixin, BaseEstimator):
    """``peak ~ sum_k coef_k * term_k + constant``, all coefficients >= 0 (a scikit-learn regressor).

    ``X``: a DataFrame whose columns include ``features`` (bytes of each named term), ``y``: measured
    peak bytes. The loss is the squared (relative, by default) error plus ``alpha`` x n_samples x
    sum_k (coef_k - 1)^2: a prior that each term is what the estimator says. Without it, terms that
    grow together (token ids and activations both scale with s x b) trade places and a fit reads
    "token_ids x 631, activations x 0", right on these runs and wrong on the next. A feature that is
    zero in every training run keeps coefficient 1, the analytical value, and is listed in
    ``unfitted_`` (a CPU FP32 study says nothing about BF16 parameter copies: applied on a GPU, the
    profile keeps that term as the estimator computes it).
    """

    def __init__(
        self,
        features: tuple[str, ...] = TERMS,
        *,
        alpha: float = 1e-4,
        relative: bool = True,
        constant: bool = True,
    ):
        self.features = features
        self.alpha = alpha
        self.relative = relative
        self.constant = constant

    def _matrix(self, X) -> np.ndarray:
        if isinstance(X, pd.DataFrame):
            missing = [f for f in self.features if f not in X.columns]
            if missing:
                raise CalibrationError(f"X lacks feature columns {missing}")
            return X[list(self.features)].to_numpy(dtype=float)
        X = np.asarray(X, dtype=float)
        if X.ndim != 2 or X.shape[1] != len(self.features):
            raise CalibrationError(f"X must have {len(self.features)} columns ({', '.join(self.features)})")
        return X

    def fit(self, X, y, sample_weight=None) -> MemoryCalibrator:
        A = self._matrix(X) / MIB  # MiB keeps the least-squares problem well scaled
        y = np.asarray(y, dtype=float) / MIB
        if len(y) == 0:
            raise CalibrationError("no measured runs to fit")
        fitted = np.abs(A).sum(axis=0) > 0
        self.unfitted_ = tuple(f for f, ok in zip(self.features, fitted, strict=True) if not ok)
        weight = np.ones_like(y) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        if self.relative:
            weight = weight / np.maximum(y, 1e-9) ** 2
        design = A[:, fitted]
        k = design.shape[1]
        prior = np.eye(k)  # one row per coefficient: residual (1 - coef_k), weight alpha x n
        target = np.concatenate([y, np.ones(k)])
        weight = np.concatenate([weight, np.full(k, self.alpha * len(y))])
        design = np.vstack([design, prior])
        if self.constant:  # no prior on the constant
            design = np.column_stack([design, np.r_[np.ones(len(y)), np.zeros(k)]])
        reg = LinearRegression(fit_intercept=False, positive=True).fit(design, target, sample_weight=weight)
        coef = np.ones(len(self.features))
        coef[fitted] = reg.coef_[:k]
        self.coef_ = coef
        self.constant_bytes_ = float(reg.coef_[-1] * MIB) if self.constant else 0.0
        self.n_fit_ = len(y)
        return self

    def predict(self, X) -> np.ndarray:
        check_is_fitted(self, "coef_")
        return self._matrix(X) @ self.coef_ + self.constant_bytes_

    def describe(self) -> str:
        """The fit as one readable line: ``activations x 1.07 + logits x 1.31 + 12.0 MiB``."""
        check_is_fitted(self, "coef_")
        parts = [
            f"{name} x {c:.3f}" + (" (unfitted)" if name in self.unfitted_ else "")
            for name, c in zip(self.features, self.coef_, strict=True)
            if c > 0 or name in self.unfitted_
        ]
        return " + ".join([*parts, f"{self.constant_bytes_ / MIB:.1f} MiB"])


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Dataset:
    """A results frame prepared for calibration: the runs with a known outcome, their specs' terms
    for each engine, and which of them have a measured peak to fit."""

    frame: pd.DataFrame  # the runs (status ok or oom), index 0..n-1
    terms: dict[str, pd.DataFrame]  # engine -> peak terms (bytes) per run, one column per TERMS
    raw_bytes: dict[str, np.ndarray]  # engine -> the engine's own estimate (max over stages)
    specs: list[RunSpec]
    # engine -> the reserved level's mechanism terms at the worst stage (bytes per run; 0 on the CPU):
    # what the fitted fragmentation comes on top of (harness/analysis/fragmentation.py)
    mechanism: dict[str, np.ndarray] = field(default_factory=dict)
    # engine -> the uncalibrated reserved level as a trace's replay counts it (no cuBLAS workspace,
    # which a trace does not hold); the memory outside the allocator (CUDA context, NCCL) per run
    reserved_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    outside_bytes: np.ndarray | None = None
    # engine -> the stage whose reserved level is the highest (``Estimate.reserved_worst``; under a
    # pipeline often not the allocated worst: the last stage's loss blocks, stage 0's embedding): its
    # peak terms, its mechanism terms, and how far below the allocated worst's peak its own lies
    reserved_stage_terms: dict[str, pd.DataFrame] = field(default_factory=dict)
    reserved_stage_mechanism: dict[str, np.ndarray] = field(default_factory=dict)
    reserved_stage_below: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def measured(self) -> np.ndarray:
        """Rows whose measured peak is the run's whole peak: ok runs, and simulated or fake out-of-memory
        runs (the CPU step, or the fake trace, completes and its peak is kept); a real CUDA OOM stops
        mid-step."""
        f = self.frame
        complete = (f["status"] == "ok") | f.get("oom_source", pd.Series(None, index=f.index)).isin(
            ["simulated", "fake"]
        )
        return (complete & f["peak_allocated_bytes"].notna() & (f["peak_allocated_bytes"] > 0)).to_numpy()

    @property
    def capacity(self) -> np.ndarray:
        return np.array([s.device.memory_bytes for s in self.specs], dtype=float)

    @property
    def oom(self) -> np.ndarray:
        return (self.frame["status"] == "oom").to_numpy()


def prepare(frame: pd.DataFrame) -> Dataset:
    """Keep the runs whose outcome says something about memory (ok, oom) and compute every engine's
    terms for each run's spec (from the spec columns, so an improved estimator needs no rerun)."""
    runs = frame[frame["status"].isin(["ok", "oom"])].reset_index(drop=True)
    if "config_id" in runs:
        runs = runs.sort_values("config_id", kind="stable").reset_index(drop=True)
    specs, bad = [], []
    for i, row in runs.iterrows():
        try:
            specs.append(from_flat(row.to_dict()))
        except (InvalidSpec, KeyError, TypeError, ValueError) as exc:
            bad.append(f"row {i} ({row.get('config_id')}): {exc}")
    if bad:
        raise CalibrationError("cannot rebuild the spec of some runs: " + "; ".join(bad[:3]))
    terms, raw, mechanism, reserved = {}, {}, {}, {}
    stage_terms, stage_mechanism, stage_below = {}, {}, {}
    outside = np.zeros(len(specs))
    for engine in ENGINES_COMPARED:
        ests = [estimate(s, engine=engine) for s in specs]
        terms[engine] = pd.DataFrame([peak_terms(e.worst.terms) for e in ests], columns=list(TERMS))
        raw[engine] = np.array([e.total_bytes for e in ests], dtype=float)
        mechanism[engine] = np.array([levels.mechanism_bytes(e) for e in ests], dtype=float)
        reserved[engine] = np.array(
            [e.reserved_total_bytes - e.reserved_terms()["cublas_workspace"] for e in ests],
            dtype=float,
        )
        outside = np.array([e.outside_allocator_bytes for e in ests], dtype=float)
        stage_terms[engine] = pd.DataFrame(
            [peak_terms(e.reserved_worst.terms) for e in ests], columns=list(TERMS)
        )
        stage_mechanism[engine] = np.array(
            [levels.mechanism_bytes(e, e.reserved_worst) for e in ests], dtype=float
        )
        stage_below[engine] = np.array([e.total_bytes - e.reserved_worst.total_bytes for e in ests], float)
    return Dataset(
        runs, terms, raw, specs, mechanism, reserved, outside, stage_terms, stage_mechanism, stage_below
    )


def groups_of(data: Dataset, group_by: str) -> np.ndarray:
    """The cross-validation group of each run: held-out runs are new world sizes, models, layouts or
    layout families."""
    if group_by not in GROUPINGS:
        raise CalibrationError(f"group_by={group_by!r} must be one of {', '.join(GROUPINGS)}")
    return np.array([group_of(s, group_by) for s in data.specs])


def group_of(s: RunSpec, group_by: str) -> int | str:
    """One run's group (``group_by`` one of :data:`GROUPINGS`). A layout family is the memory
    mechanisms a layout brings, whatever its degrees: the pipeline schedule (or none), how the data
    parallel ranks hold the states (DDP, ZeRO-1, FSDP2), context parallelism or not, and what is
    recomputed — ``1f1b·ddp·cp·full``; a family held out is a combination no fitted run had."""
    p, t = s.parallel, s.train
    if group_by == "world":
        return p.world
    if group_by == "model":
        return json.dumps([s.model.hidden_size, s.model.num_layers])
    if group_by == "layout":
        return f"{p.tp}-{p.pp}-{p.cp}"
    states = "ddp" if p.dp * p.cp == 1 or p.zero_stage == 0 else ("zero1" if p.zero_stage == 1 else "fsdp2")
    parts = [p.pp_schedule if p.pp > 1 else "no-pp", states, *(["cp"] if p.cp > 1 else []), t.recompute]
    return "·".join(parts)


# ----------------------------------------------------------------------------------------- evaluation


@dataclass
class Evaluation:
    """Held-out predictions of every estimator, their accuracy, and the calibrator fitted on all runs."""

    data: Dataset
    engine: str
    group_by: str
    predictions: dict[str, np.ndarray]  # estimator -> predicted peak bytes per run (calibrated: held-out)
    metrics: dict[str, dict[str, Any]]
    model: MemoryCalibrator  # fitted on every measured run: the profile
    fold_coefs: np.ndarray  # (folds, features): the spread of coefficients across folds
    fragmentation: dict[str, float] | None
    fold_models: list[MemoryCalibrator] = field(default_factory=list)  # one per fold
    fold_of: np.ndarray | None = None  # run -> the fold whose model never saw it

    def held_out(self, run: int, terms: dict[str, int]) -> float:
        """The calibrated estimate of one stage's ``terms`` of run ``run`` by the model that never saw
        the run's group (every pipeline stage, every ZeRO-1 partition is judged held out as the runs are)."""
        row = np.array([peak_terms(terms)[k] for k in self.fold_models[0].features], dtype=float)[None, :]
        return float(self.fold_models[int(self.fold_of[run])].predict(row)[0])

    @functools.cached_property
    def rank_errors(self) -> dict[str, pd.DataFrame]:
        """Every pipeline stage and every ZeRO-1 partition against the raw engine's figure and the
        calibrated one held out (harness/analysis/stages.py): ``{"stages"|"partitions": errors}``, made
        once for the profile, ``calibrate``'s lines and the report."""
        return {
            "stages": stage_errors(self.data, engine=self.engine, predict=self.held_out),
            "partitions": partition_errors(self.data, engine=self.engine, predict=self.held_out),
        }

    @functools.cached_property
    def stage_metrics(self) -> dict[str, Any]:
        """:attr:`rank_errors` summarised: ``{"stages"|"partitions": {"raw"|"calibrated": summary}}``,
        empty where the runs have neither."""
        out: dict[str, Any] = {}
        for name, errors in self.rank_errors.items():
            if len(errors):
                out[name] = {
                    "raw": stage_summary(errors)[-1],
                    "calibrated": stage_summary(errors, "calibrated_error")[-1],
                }
        return out


def evaluate(
    frame: pd.DataFrame, *, engine: str = "torch", group_by: str = "world", data: Dataset | None = None
) -> Evaluation:
    """Fit and judge: the calibrated estimator's predictions are made by a model that never saw the
    run's group (GroupKFold); the raw engines need no fit and are judged on the same runs. ``data``:
    ``prepare(frame)`` when already made (another grouping of the same runs)."""
    if engine not in ENGINES_COMPARED:
        raise CalibrationError(f"engine={engine!r} must be one of {', '.join(ENGINES_COMPARED)}")
    data = prepare(frame) if data is None else data
    measured = data.measured
    if measured.sum() < 3:
        raise CalibrationError(f"{int(measured.sum())} runs with a measured peak: at least 3 are needed")
    X, y = data.terms[engine], data.frame["peak_allocated_bytes"].to_numpy(dtype=float)
    groups = groups_of(data, group_by)
    n_groups = len(set(groups[measured]))
    if n_groups < 2:
        raise CalibrationError(
            f"group_by={group_by}: every measured run is in one group ({groups[measured][0]}), so no run "
            "can be held out; choose another grouping"
        )
    held_out = np.full(len(y), np.nan)
    coefs, models, fold_of = [], [], np.full(len(y), -1)
    for k, (train, test) in enumerate(GroupKFold(n_splits=min(5, n_groups)).split(X, y, groups)):
        fit_rows = train[measured[train]]
        model = MemoryCalibrator().fit(X.iloc[fit_rows], y[fit_rows])
        coefs.append(model.coef_)
        models.append(model)
        fold_of[test] = k
        # a group with no measured run (all real OOMs) is predicted by the folds that hold it out
        held_out[test] = model.predict(X.iloc[test])
    unseen = np.isnan(held_out)  # groups that GroupKFold never held out (cannot happen with >=2 groups)
    if unseen.any():
        raise CalibrationError(f"{int(unseen.sum())} runs were never held out")
    final = MemoryCalibrator().fit(X[measured], y[measured])
    predictions = {name: data.raw_bytes[name] for name in ENGINES_COMPARED}
    predictions["calibrated"] = held_out
    metrics = {name: accuracy(data, predictions[name]) for name in ESTIMATORS}
    # The reserved level is judged at the stage where the engine's is highest, as ``estimate`` applies a
    # profile (every stage, then the max): that stage's calibrated peak held out by the same folds
    Xr = data.reserved_stage_terms.get(engine, X)
    held_out_stage = np.full(len(y), np.nan)
    for k, model in enumerate(models):
        rows = np.flatnonzero(fold_of == k)
        held_out_stage[rows] = model.predict(Xr.iloc[rows])
    reserved = frag.evaluate_reserved(
        data.frame,
        Xr,
        held_out_stage,
        measured=measured,
        groups=groups,
        capacity=data.capacity,
        mechanism=data.reserved_stage_mechanism.get(engine, data.mechanism.get(engine)),
        below=data.reserved_stage_below.get(engine),
        on_card=card_outcomes(data.frame),
    )
    fragmentation = None
    if reserved is not None:
        fragmentation = reserved.model.as_profile(target=reserved.target, metrics=reserved.metrics)
        predictions["calibrated_reserved"] = reserved.predicted
    return Evaluation(
        data, engine, group_by, predictions, metrics, final, np.array(coefs), fragmentation, models, fold_of
    )


def accuracy(data: Dataset, predicted: np.ndarray) -> dict[str, Any]:
    """Errors on measured runs and the out-of-memory verdicts on every run.

    ``ape``: |predicted - measured| / measured. ``max_under_prediction``: the largest
    (measured - predicted) / measured (positive: the estimator said less than the run used).
    ``safe_threshold``: the largest utilisation (predicted / capacity) below which no run ran out of
    memory (the paper's rule, measured); None when no run ran out of memory. ``excluded_at_safe``: runs
    that did fit but sit at or above it. At the paper's 80 %: runs that ran out of memory below it
    (the rule broken) and runs that fit above it (excluded for nothing).
    """
    m = data.measured
    y = data.frame["peak_allocated_bytes"].to_numpy(dtype=float)
    err = (predicted[m] - y[m]) / y[m]
    util = predicted / data.capacity
    oom, ok = data.oom, ~data.oom
    return {
        "runs": len(y),
        "measured_runs": int(m.sum()),
        **frag.held_out_figures(err, util, ran_out=oom, fitted=ok),
        "oom_below_paper_threshold": int((oom & (util <= PAPER_THRESHOLD)).sum()),
        "excluded_at_paper_threshold": int((ok & (util > PAPER_THRESHOLD)).sum()),
    }


# ------------------------------------------------------------------------------------------- profiles


def profile_of(ev: Evaluation, *, results_dir: str) -> dict[str, Any]:
    """The versioned profile: coefficients by feature name, what they were fitted on, how good they are."""
    model, data = ev.model, ev.data
    ids = data.frame.loc[data.measured, "config_id"].tolist() if "config_id" in data.frame else []
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "harness_version": __version__,
        "engine": ev.engine,
        "target": "peak_allocated_bytes",
        "features": list(model.features),
        "coefficients": {f: round(float(c), 6) for f, c in zip(model.features, model.coef_, strict=True)},
        "unfitted": list(model.unfitted_),
        "constant_bytes": round(model.constant_bytes_),
        "fragmentation": ev.fragmentation,
        "summary": model.describe(),
        "fitted_on": {
            "results_dir": results_dir,
            "count": len(ids),
            "config_ids": sorted(ids),
            **fitted_on(
                [s for s, m in zip(data.specs, data.measured, strict=True) if m], _torch_versions(data)
            ),
        },
        "cross_validation": {"group_by": ev.group_by, "folds": len(ev.fold_coefs)},
        "metrics": ev.metrics,
        # every pipeline stage and ZeRO-1 partition, raw and calibrated held out (issue 30 item 3)
        "per_rank": ev.stage_metrics,
    }


def save_profile(profile: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: two calibrations saving at once raced on one fixed temporary name (issue 29).
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(profile, indent=1, sort_keys=False) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _torch_versions(data: Dataset) -> list[str]:
    column = data.frame.get("env_torch_version")
    return [] if column is None else sorted({str(v) for v in column.dropna()})
