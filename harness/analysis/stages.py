"""Every pipeline stage judged (issue 30 item 3): each stage's most-loaded rank against that stage's
estimate, not only the worst rank against the worst stage; every rank of a ZeRO-1 run against its own
partition's; the report's section on both.

A record's ``per_rank_peak_bytes`` holds every rank's peak in rank order, or, for a fake run, each
traced rank's (``fake_traced_ranks``: one per stage stands for its ranks); the runner's mesh is
(pp, dp, cp, tp), so rank r is on stage r // (dp·cp·tp). An estimate has one ``StageEstimate`` per
pipeline rank. Runs without a pipeline have one stage, the worst rank's, which the memory table
already judges: they are left out here.

No torch here; pandas for the table.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from harness.analysis.markdown import pct, table
from harness.estimate import estimate
from harness.estimate.params import param_numels, zero1_partitions
from harness.estimate.terms import peak_bytes
from harness.spec import stage_view

# (run index in the Dataset, a stage's terms) -> predicted peak bytes
Predict = Callable[[int, dict[str, int]], float]

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


def stage_errors(data, *, engine: str = "torch", predict: Predict | None = None) -> pd.DataFrame:
    """One row per (run, pipeline stage) of the measured runs with a pipeline: ``config_id``,
    ``stage``, ``position`` (first, middle, last), ``measured`` (the stage's most-loaded rank),
    ``estimated`` (the engine's figure for that stage) and ``error`` ((estimated − measured) /
    measured); with ``predict`` (the calibrated estimator, held out: see :func:`calibrate.evaluate`)
    also ``calibrated_error``, the same for ``predict(run index, the stage's terms)``. ``data``: a
    :class:`harness.analysis.calibrate.Dataset`."""
    rows = []
    frame = data.frame
    columns = ["config_id", "stage", "position", "measured", "estimated", "error"]
    columns += ["calibrated_error"] if predict else []
    if "per_rank_peak_bytes" not in frame:
        return pd.DataFrame(rows, columns=columns)
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
                    **_calibrated(predict, i, st.terms, measured),
                }
            )
    return pd.DataFrame(rows, columns=columns)


def _calibrated(predict: Predict | None, run: int, terms: dict[str, int], measured: float) -> dict:
    return {"calibrated_error": (predict(run, terms) - measured) / measured} if predict else {}


def partition_errors(data, *, engine: str = "torch", predict: Predict | None = None) -> pd.DataFrame:
    """One row per rank of the measured ZeRO-1 runs (d·c > 1, every rank's peak recorded) on the stages
    whose ZeRO-1 partitions differ: ``config_id``, ``stage``, ``partition`` (the rank's place in its
    ZeRO group), ``measured`` (that rank's peak), ``estimated`` and ``error``.

    ``ZeroRedundancyOptimizer`` gives each rank of the group whole parameters
    (:func:`params.zero1_partitions`); the engine's stage figure is the most-loaded partition's, and a
    rank's own is the same with its partition's AdamW state (8 B per element) and step temporaries
    (4 B): the ranks of one stage differ in nothing else (on the second CPU study's ZeRO-1 runs the
    measured peaks of a stage's ranks differ by these bytes to within 68). The runner's mesh is (pp, dp,
    cp, tp) and the ZeRO group the flattened dp × cp, so rank r is group rank (r // t) mod d·c.
    ``predict``: as :func:`stage_errors`'s."""
    rows = []
    frame = data.frame
    columns = ["config_id", "stage", "partition", "measured", "estimated", "error"]
    columns += ["calibrated_error"] if predict else []
    if "per_rank_peak_bytes" not in frame:
        return pd.DataFrame(rows, columns=columns)
    for i in np.flatnonzero(data.measured):
        spec = data.specs[i]
        p = spec.parallel
        shards = p.dp * p.cp
        row = frame.iloc[i]
        peaks = np.asarray(
            row["per_rank_peak_bytes"] if row["per_rank_peak_bytes"] is not None else [], float
        )
        traced = row.get("fake_traced_ranks")
        if p.zero_stage != 1 or shards == 1 or peaks.size != p.world:
            continue
        if traced is not None and len(traced):  # a fake run traces one rank per stage
            continue
        est = estimate(spec, engine=engine)
        for stage, st in enumerate(est.stages):
            view = stage_view(spec, stage)
            parts = zero1_partitions(param_numels(view.model, stage=stage, pp=p.pp, tp=p.tp), shards)
            if len(set(parts)) == 1:
                continue
            per_stage = shards * p.tp
            for rank in range(stage * per_stage, (stage + 1) * per_stage):
                fewer = max(parts) - parts[rank // p.tp % shards]
                terms = dict(st.terms)
                terms["optimizer"] -= 8 * fewer
                terms["optimizer_step"] -= 4 * fewer
                figure = float(peak_bytes(terms))
                rows.append(
                    {
                        "config_id": row.get("config_id"),
                        "stage": stage,
                        "partition": rank // p.tp % shards,
                        "measured": peaks[rank],
                        "estimated": figure,
                        "error": (figure - peaks[rank]) / peaks[rank],
                        **_calibrated(predict, i, terms, peaks[rank]),
                    }
                )
    return pd.DataFrame(rows, columns=columns)


def summary(errors: pd.DataFrame, column: str = "error") -> list[dict[str, object]]:
    """By stage position, then all together: stages, median error, 95th percentile of |error|, worst
    under-prediction, and the share under-predicted by at most 2 %, of ``column`` (``error``, or
    ``calibrated_error``). A :func:`partition_errors` frame (no positions) is one group, "partitions"."""
    out = []
    if "position" not in errors:
        groups = [("partitions", errors)]
    else:
        groups = [(pos, errors[errors["position"] == pos]) for pos in POSITIONS] + [("all", errors)]
    for name, g in groups:
        if g.empty:
            continue
        e = g[column].to_numpy(dtype=float)
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


STAGE_COLUMNS = ["stage", "stages", "median error", "p95 abs. error", "worst under", "within 2 % under"]


def _rows(summaries: list[dict[str, object]], *, suffix: str = "") -> list[list[str]]:
    return [
        [
            f"{r['position']}{suffix}",
            str(r["stages"]),
            f"{r['median']:+.2%}",
            pct(r["p95_abs"]),
            pct(r["worst_under"]),
            pct(r["within_2pct_under"]),
        ]
        for r in summaries
    ]


def stages_section(ev) -> list[str]:
    """The report's section: every pipeline stage's most-loaded rank against that stage's estimate, and
    every rank of a ZeRO-1 run against its own partition's, by the engine and by the calibrated
    estimator held out (``ev``: a :class:`harness.analysis.calibrate.Evaluation`); nothing when the
    runs have neither."""
    errors, partitions = ev.rank_errors["stages"], ev.rank_errors["partitions"]
    out = []
    calibrated = " (calibrated)"
    if not errors.empty:
        worst = errors.loc[errors["error"].idxmin()]
        out += [
            "## Every pipeline stage",
            "",
            f"Each stage's most-loaded rank against the `{ev.engine}` engine's figure for that stage, over "
            f"the {errors['config_id'].nunique()} measured runs with a pipeline (the memory table above "
            "judges only each run's worst rank), and against the calibrated estimate of the same stage, "
            "held out as the runs are. Error = (estimated − measured) / measured.",
            "",
            *table(
                STAGE_COLUMNS,
                _rows(summary(errors)) + _rows(summary(errors, "calibrated_error")[-1:], suffix=calibrated),
            ),
            "",
            f"Worst under-prediction: stage {int(worst['stage'])} of `{worst['config_id']}`, "
            f"{-worst['error']:.2%} under ({worst['measured'] / 2**20:.1f} MiB measured).",
            "",
        ]
    if not partitions.empty:
        out += [
            "## Every ZeRO-1 partition",
            "",
            "ZeRO-1 gives each rank of its group whole parameters, so the ranks of one stage hold "
            "different optimizer states: each rank of the "
            f"{partitions['config_id'].nunique()} measured ZeRO-1 runs whose partitions differ, against "
            f"the `{ev.engine}` engine's figure for its own partition, and the calibrated one held out.",
            "",
            *table(
                ["", "ranks", *STAGE_COLUMNS[2:]],
                _rows(summary(partitions))
                + _rows(summary(partitions, "calibrated_error"), suffix=calibrated),
            ),
            "",
        ]
    return out
