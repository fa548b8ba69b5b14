"""Fragmentation, fitted: the reserved level above the allocated peak, learned from runs that report a
reserved peak — measured on CUDA (``peak_reserved_bytes``) or replayed through the caching-allocator
model from a CPU run's own trace (``sim_peak_reserved_bytes``, harness/alloc).

    reserved - allocated - mechanism ~ a x transient + b x states + c        (a, b, c >= 0)

``mechanism`` is what the estimator's reserved level already derives from the caching allocator's
rules (harness/estimate/segments.py and loss_cache.py: segment rounding, the gradient-reduction
stream's segments, the blocks cached at the loss, the optimizer step's new segments; 0 on the CPU and
for profiles fitted before it existed, whose ``fragmentation`` section has no ``over_mechanism``): the
fit learns only what those rules leave.

``states`` are the estimate's parameters, gradients and optimizer state: allocated once, they leave few
holes; ``transient`` is the rest of the estimated peak (activations and temporary buffers), freed and
allocated again every micro-batch in sizes that do not fit each other's holes — where the caching
allocator's cached-but-free blocks come from. The target is the measured (or simulated) reserved peak
minus the measured allocated peak, so the fit adds to an allocated prediction what the allocator adds
on top of it. Judged held out like the allocated fit, at the reserved level.

No torch here; scikit-learn for the regression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted

from harness.estimate.terms import STATE_TERMS

MIB = 2**20
FEATURES = ("transient", "states")
MIN_RUNS = 5


def reserved_target(frame: pd.DataFrame) -> tuple[np.ndarray, str | None]:
    """Each run's reserved peak (NaN where unknown) and which column it came from: the measured CUDA
    peak where any run has one, else the replayed one (CPU studies)."""
    for column in ("peak_reserved_bytes", "sim_peak_reserved_bytes"):
        if column in frame and frame[column].notna().any() and (frame[column].fillna(0) > 0).any():
            values = frame[column].to_numpy(dtype=float)
            return np.where(values > 0, values, np.nan), column
    return np.full(len(frame), np.nan), None


def features(terms: pd.DataFrame) -> pd.DataFrame:
    """``transient`` and ``states`` bytes of each run from its estimate's peak terms."""
    states = terms[list(STATE_TERMS)].sum(axis=1)
    return pd.DataFrame({"transient": terms.sum(axis=1) - states, "states": states})


class FragmentationModel(RegressorMixin, BaseEstimator):
    """``reserved - allocated ~ a x transient + b x states + c``, all non-negative (scikit-learn
    regressor on :func:`features`)."""

    def fit(self, X: pd.DataFrame, y) -> FragmentationModel:
        A = X[list(FEATURES)].to_numpy(dtype=float) / MIB
        y = np.maximum(0.0, np.asarray(y, dtype=float)) / MIB
        reg = LinearRegression(positive=True).fit(A, y)
        self.coef_ = reg.coef_.copy()
        self.constant_bytes_ = float(max(0.0, reg.intercept_) * MIB)
        if reg.intercept_ < 0:  # refit through the origin: a negative constant would subtract memory
            self.coef_ = LinearRegression(positive=True, fit_intercept=False).fit(A, y).coef_
        self.n_fit_ = len(y)
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self, "coef_")
        return X[list(FEATURES)].to_numpy(dtype=float) @ self.coef_ + self.constant_bytes_

    def describe(self) -> str:
        check_is_fitted(self, "coef_")
        return (
            f"transient x {self.coef_[0]:.4f} + states x {self.coef_[1]:.4f} + "
            f"{self.constant_bytes_ / MIB:.1f} MiB"
        )

    def as_profile(self, *, target: str, metrics: dict[str, Any]) -> dict[str, Any]:
        """The profile's ``fragmentation`` section."""
        return {
            "per_transient_byte": round(float(self.coef_[0]), 6),
            "per_state_byte": round(float(self.coef_[1]), 6),
            "constant_bytes": round(self.constant_bytes_),
            "over_mechanism": True,
            "target": target,
            "summary": self.describe(),
            "fitted_runs": self.n_fit_,
            "held_out": metrics,
        }


def apply(section: dict[str, Any], *, transient: float, states: float) -> float:
    """The bytes a profile's ``fragmentation`` section adds to an allocated peak."""
    return (
        section["per_transient_byte"] * transient
        + section["per_state_byte"] * states
        + section["constant_bytes"]
    )


# The verdicts of a trace replayed against the card's capacity (harness.alloc.CAPACITY_VERDICTS) that
# say the step ran out of memory; "fits_after_flush" ran, slower (the cache released and retried).
RAN_OUT = ("oom_fragmentation", "oom_allocated")


def card_outcomes(frame: pd.DataFrame) -> pd.Series | None:
    """Each run's ``sim_capacity_verdict`` (its trace replayed against what the card's allocator may
    reserve, issue 32), None where no run has one; missing verdicts are NaN."""
    column = frame.get("sim_capacity_verdict")
    if column is None or column.isna().all():
        return None
    return column.reset_index(drop=True)


def held_out_figures(err: np.ndarray, util: np.ndarray, *, ran_out: np.ndarray, fitted: np.ndarray) -> dict:
    """Errors and the safe threshold, as every level is judged: ``err`` the relative errors of the runs
    with a measurement, ``util`` each run's predicted utilisation; the safe threshold is the lowest
    utilisation of a run that ran out (None when none did), and ``excluded_at_safe`` counts the runs
    that fitted at or above it."""
    return {
        "median_ape": float(np.median(np.abs(err))),
        "p95_ape": float(np.percentile(np.abs(err), 95)),
        "max_under_prediction": float(max(0.0, (-err).max())),
        **safe_threshold(util, ran_out=ran_out, fitted=fitted),
    }


def safe_threshold(util: np.ndarray, *, ran_out: np.ndarray, fitted: np.ndarray) -> dict[str, Any]:
    """``safe_threshold``: the lowest predicted utilisation of a run that ran out (None when none did);
    ``excluded_at_safe``: the runs that fitted at or above it."""
    safe = float(util[ran_out].min()) if ran_out.any() else None
    return {
        "safe_threshold": safe,
        "excluded_at_safe": int((fitted & (util >= safe)).sum()) if safe is not None else 0,
    }


@dataclass
class ReservedFit:
    model: FragmentationModel
    target: str
    predicted: np.ndarray  # held-out reserved prediction per run (NaN where no target)
    metrics: dict[str, Any]


def evaluate_reserved(
    frame: pd.DataFrame,
    terms: pd.DataFrame,
    allocated_held_out: np.ndarray,
    *,
    measured: np.ndarray,
    groups: np.ndarray,
    capacity: np.ndarray,
    mechanism: np.ndarray | None = None,
    below: np.ndarray | None = None,
    on_card: pd.Series | None = None,
) -> ReservedFit | None:
    """Fit the fragmentation on every run with a reserved peak and judge, held out by ``groups``, the
    reserved level ``allocated_held_out + fragmentation`` against it: median and 95th-percentile APE,
    worst under-prediction, and the safe threshold recomputed at the reserved level (a run "runs out"
    there when its trace, replayed against what the card's allocator may reserve, runs out —
    ``on_card``, :func:`card_outcomes` — and, for a run without that replay, when its reserved peak
    exceeds the capacity). None when fewer than ``MIN_RUNS`` runs have one. ``terms``, ``mechanism``
    and ``allocated_held_out`` are of the stage the reserved level is judged at; ``below``: how far that
    stage's peak lies below the run's (whose measured peak is the allocated worst's), per run."""
    reserved, column = reserved_target(frame)
    rows = measured & ~np.isnan(reserved)
    if column is None or rows.sum() < MIN_RUNS or len(set(groups[rows])) < 2:
        return None
    X = features(terms)
    allocated = frame["peak_allocated_bytes"].to_numpy(dtype=float)
    share = (reserved - allocated) / reserved  # of the reserved peak above the measured one
    if below is not None:  # the judged stage's peak: the measured one less the engine's difference
        allocated = allocated - np.asarray(below, dtype=float)
    extra = reserved - allocated
    mech = np.zeros(len(frame)) if mechanism is None else np.asarray(mechanism, dtype=float)
    left = extra - mech  # what the allocator's rules in the estimator do not derive
    held = np.full(len(frame), np.nan)
    idx = np.flatnonzero(rows)
    for train, test in GroupKFold(n_splits=min(5, len(set(groups[rows])))).split(idx, groups=groups[idx]):
        m = FragmentationModel().fit(X.iloc[idx[train]], left[idx[train]])
        held[idx[test]] = allocated_held_out[idx[test]] + mech[idx[test]] + m.predict(X.iloc[idx[test]])
    final = FragmentationModel().fit(X.iloc[idx], left[idx])
    err = (held[rows] - reserved[rows]) / reserved[rows]
    util = held / capacity
    over = reserved > capacity  # would have run out at the reserved level
    if on_card is not None:  # the capacity-aware replay's verdict, where the run has one
        known = on_card.notna().to_numpy()
        over = np.where(known, on_card.isin(RAN_OUT).to_numpy(), over)
    over = rows & over
    metrics = {
        "target": column,
        "runs": int(rows.sum()),
        **held_out_figures(err, util, ran_out=over, fitted=rows & ~over),
        "median_fragmentation_share": float(np.median(share[rows])),
    }
    return ReservedFit(final, column, held, metrics)
