"""The engines against the fake-tensor traces of the published grids (issue 14 items 3 and 4).

For each results directory (default: results/paper_fake/a100_40gb, h100_94gb and the extended grid of
issue 32) and for them together:
- how far each engine's allocated-level estimate is from the traced peak (the worst traced rank):
  median and p95 of the absolute error, the worst under-prediction, and the share within 2 % both ways
  (issue 14's goal for the torch engine: at least 95 % of points);
- the published 80 % rule re-examined: of the points an engine puts below 80 % of the card, how many the
  trace puts over it, at the allocated level (traced peak) and at the reserved level (the trace replayed
  through the caching-allocator model, harness/alloc, with no capacity: the segments an unbounded card
  would keep; over capacity there means the allocator must at least release its cache and retry, not
  that the run fails);
- the torch engine's largest differences, by layout, to be named.
Points that are ``invalid`` or ``timeout`` say nothing about memory and are left out (counted).
Run: python scripts/paper_fake_facts.py [RESULTS_DIR ...]
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from harness.analysis.calibrate import prepare
from harness.analysis.report import layout_label
from harness.estimate import ENGINES, estimate
from harness.sweep.store import load_results

DEFAULT = ["results/paper_fake/a100_40gb", "results/paper_fake/h100_94gb", "results/paper_fake/extended"]
RULE = 0.8


def summary(name: str, frame: pd.DataFrame) -> None:
    counts = frame["status"].value_counts().to_dict()
    data = prepare(frame)
    f = data.frame
    traced = f["peak_allocated_bytes"].to_numpy(dtype=float)
    capacity = np.array([s.device.memory_bytes for s in data.specs], dtype=float)
    reserved = f["sim_peak_reserved_bytes"].to_numpy(dtype=float) if "sim_peak_reserved_bytes" in f else None
    print(f"== {name}: {len(f)} traced points (statuses: {counts})")
    print(f"   over capacity when traced: {(traced > capacity).sum()} at the allocated level", end="")
    if reserved is not None:
        print(f", {(reserved > capacity).sum()} at the reserved level (replay, no capacity)")
    else:
        print()
    print(
        "   engine     median |err|   p95 |err|   worst under   within 2 %   "
        "below 80 %: over capacity (alloc / reserved)"
    )
    for engine in ENGINES:
        est = data.raw_bytes[engine]
        err = (est - traced) / traced
        under = max(0.0, -err.min())
        below = est / capacity < RULE
        over_alloc = int((below & (traced > capacity)).sum())
        over_res = int((below & (reserved > capacity)).sum()) if reserved is not None else 0
        print(
            f"   {engine:<9} {np.median(np.abs(err)):>12.1%} {np.quantile(np.abs(err), 0.95):>11.1%} "
            f"{under:>13.1%} {(np.abs(err) <= 0.02).mean():>12.1%}   {int(below.sum())} points: "
            f"{over_alloc} / {over_res}"
        )
    if reserved is not None:
        reserved_level(f, data, reserved)
    err = (data.raw_bytes["torch"] - traced) / traced
    print("   torch engine's largest differences (error, traced GiB, model, layout):")
    for i in np.argsort(-np.abs(err))[:10]:
        row = f.iloc[i]
        print(f"   {err[i]:+7.1%} {traced[i] / 2**30:7.2f}  {row['model_name']:<11} {layout_label(row)}")
    by = pd.DataFrame(
        {
            "model": f["model_name"],
            "pp": f["parallel_pp"],
            "tp": f["parallel_tp"],
            "cp": f["parallel_cp"],
            "err": err,
        }
    )
    print("   torch engine by model and pipeline depth: median error, worst under, points")
    for (model, pp), g in by.groupby(["model", "pp"]):
        print(f"   {model:<11} pp{int(pp)}  {g['err'].median():+7.1%} {g['err'].min():+7.1%} {len(g):4d}")


def reserved_level(f: pd.DataFrame, data, replayed: np.ndarray) -> None:
    """The torch engine's reserved level (issue 32) against each point's replayed reserved peak: as the
    rows recorded it when they were traced (``est_reserved_total_bytes``: that day's engine) and as
    today's engine computes it, with its mechanism terms (harness/estimate/segments.py)."""
    today = np.array([estimate(s, engine="torch").reserved_total_bytes for s in data.specs], dtype=float)
    print(
        "   torch engine's reserved level against the replayed reserved peak: "
        "median, p95 |err|, worst under, under"
    )
    columns = (
        [("recorded", f["est_reserved_total_bytes"].to_numpy(dtype=float))]
        if "est_reserved_total_bytes" in f
        else []
    )
    for label, level in [*columns, ("today", today)]:
        err = (level - replayed) / replayed
        print(
            f"   {label:<9} {np.median(err):+12.1%} {np.quantile(np.abs(err), 0.95):>11.1%} "
            f"{-err.min():>13.1%}   {(err < 0).mean():.0%} of points"
        )


def main() -> None:
    dirs = sys.argv[1:] or DEFAULT
    frames = []
    for d in dirs:
        frame, _ = load_results(d)
        frames.append(frame)
        summary(d, frame)
    if len(frames) > 1:
        summary("together", pd.concat(frames, ignore_index=True))


if __name__ == "__main__":
    main()
