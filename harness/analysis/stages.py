"""Every pipeline stage judged (issue 30 item 3): each stage's most-loaded rank against that stage's
estimate, not only the worst rank against the worst stage.

A record's ``per_rank_peak_bytes`` holds every rank's peak in rank order, or, for a fake run, each
traced rank's (``fake_traced_ranks``: one per stage stands for its ranks); the runner's mesh is
(pp, dp, cp, tp), so rank r is on stage r // (dp·cp·tp). An estimate has one ``StageEstimate`` per
pipeline rank. Runs without a pipeline have one stage, the worst rank's, which the memory table
already judges: they are left out here.

No torch here; pandas for the table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.estimate import estimate

POSITIONS = ("first", "middle", "last")


def stage_peaks(per_rank: object, *, ranks_per_stage: int, stages: int, ranks: object = None) -> list[float]:
    """Each stage's most-loaded rank (``nan`` where none of its ranks has a figure). ``ranks``: the
    rank each figure belongs to, where the figures are not every rank's in order (a fake run's
    ``fake_traced_ranks``)."""
    values = np.asarray(per_rank if per_rank is not None else [], dtype=float)
    world = ranks_per_stage * stages
    ids = np.arange(values.size) if ranks is None else np.asarray(ranks, dtype=int)
    out = [float("nan")] * stages
    if (
        ids.size != values.size
        or (ranks is None and values.size != world)
        or (ids.size and ids.max() >= world)
    ):
        return out  # not this layout's ranks: say nothing rather than misplace them
    for rank, value in zip(ids, values, strict=True):
        stage = int(rank) // ranks_per_stage
        if np.isfinite(value) and not value <= out[stage]:  # (nan compares False: the first figure wins)
            out[stage] = float(value)
    return out


def stage_errors(data, *, engine: str = "torch") -> pd.DataFrame:
    """One row per (run, pipeline stage) of the measured runs with a pipeline: ``config_id``,
    ``stage``, ``position`` (first, middle, last), ``measured`` (the stage's most-loaded rank),
    ``estimated`` (the engine's figure for that stage) and ``error`` ((estimated − measured) /
    measured). ``data``: a :class:`harness.analysis.calibrate.Dataset`."""
    rows = []
    frame = data.frame
    if "per_rank_peak_bytes" not in frame:
        return pd.DataFrame(
            rows, columns=["config_id", "stage", "position", "measured", "estimated", "error"]
        )
    for i in np.flatnonzero(data.measured):
        spec = data.specs[i]
        p = spec.parallel
        if p.pp == 1:
            continue
        row = frame.iloc[i]
        traced = row.get("fake_traced_ranks")
        peaks = stage_peaks(
            row["per_rank_peak_bytes"],
            ranks_per_stage=p.dp * p.cp * p.tp,
            stages=p.pp,
            ranks=traced if traced is not None and len(traced) else None,
        )
        est = estimate(spec, engine=engine)
        for stage, (measured, st) in enumerate(zip(peaks, est.stages, strict=True)):
            if not measured > 0:
                continue
            position = "first" if stage == 0 else "last" if stage == p.pp - 1 else "middle"
            rows.append(
                {
                    "config_id": row.get("config_id"),
                    "stage": stage,
                    "position": position,
                    "measured": measured,
                    "estimated": float(st.total_bytes),
                    "error": (st.total_bytes - measured) / measured,
                }
            )
    return pd.DataFrame(rows, columns=["config_id", "stage", "position", "measured", "estimated", "error"])


def summary(errors: pd.DataFrame) -> list[dict[str, object]]:
    """By stage position, then all together: stages, median error, 95th percentile of |error|, worst
    under-prediction, and the share under-predicted by at most 2 %."""
    out = []
    groups = [(pos, errors[errors["position"] == pos]) for pos in POSITIONS] + [("all", errors)]
    for name, g in groups:
        if g.empty:
            continue
        e = g["error"].to_numpy(dtype=float)
        out.append(
            {
                "position": name,
                "stages": len(e),
                "median": float(np.median(e)),
                "p95_abs": float(np.quantile(np.abs(e), 0.95)),
                "worst_under": float(max(0.0, -e.min())),
                "within_2pct_under": float((e >= -0.02).mean()),
            }
        )
    return out
