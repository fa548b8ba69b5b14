"""The same points measured twice: measured peaks of two datasets matched by config_id, as ratios
(first / second), overall and by whether the point has more than one rank. Made to show what the CPU
instrument's fix (c10's running total counted on every thread, harness/runner/measure) changed:
the second study's rows as committed before the fix against the same points measured after it. Where
both have them, the replayed reserved peaks (``sim_peak_reserved_bytes``) are compared the same way,
and the points whose status differs are counted.
Run: python scripts/compare_peaks.py OLD.parquet NEW.parquet   (a results_dir works for either)
  e.g. git show 7e971e8:results/cpu_study_v2/dataset.parquet > /tmp/v2_before.parquet
       python scripts/compare_peaks.py /tmp/v2_before.parquet results/cpu_study_v2
       git show dcb52cc:results/paper_fake/h100_94gb/dataset.parquet > /tmp/h100_before.parquet
       python scripts/compare_peaks.py /tmp/h100_before.parquet results/paper_fake/h100_94gb   # the re-trace
"""

from __future__ import annotations

import argparse

import pandas as pd


def _load(path: str) -> pd.DataFrame:
    if path.endswith(".parquet"):
        return pd.read_parquet(path)
    from harness.sweep.store import load_results

    return load_results(path)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    args = ap.parse_args()
    cols = [
        "config_id",
        "peak_allocated_bytes",
        "parallel_world_size",
        "status",
        "sim_peak_allocated_bytes",
        "sim_peak_reserved_bytes",
    ]
    a, b = (_load(p) for p in (args.first, args.second))
    both = a[[c for c in cols if c in a]].merge(
        b[[c for c in cols if c in b]], on="config_id", suffixes=("_1", "_2")
    )
    print(f"{len(both)} points in both; status differs on {(both['status_1'] != both['status_2']).sum()}")
    both = both[both["status_1"].isin(["ok", "oom"]) & both["status_2"].isin(["ok", "oom"])]
    both = both[(both["peak_allocated_bytes_1"] > 0) & (both["peak_allocated_bytes_2"] > 0)]
    if both.empty:
        raise SystemExit("no point with a measured peak in both")
    both["ratio"] = both["peak_allocated_bytes_1"] / both["peak_allocated_bytes_2"]
    print(f"{len(both)} points measured in both (ratio = first / second measured peak)")
    for name, g in [
        ("all", both),
        ("one rank", both[both["parallel_world_size_1"] == 1]),
        ("several ranks", both[both["parallel_world_size_1"] > 1]),
    ]:
        if g.empty:
            continue
        r = g["ratio"]
        print(
            f"  {name:13s} n={len(g):4d}  median {r.median():.4f}  max {r.max():.4f}  min {r.min():.4f}  "
            f"first higher by > 0.5 %: {(r > 1.005).mean():.1%}, by > 2 %: {(r > 1.02).mean():.1%}"
        )
    if "sim_peak_reserved_bytes_1" in both and "sim_peak_reserved_bytes_2" in both:
        r = (both["sim_peak_reserved_bytes_1"] / both["sim_peak_reserved_bytes_2"]).dropna()
        if not r.empty:
            print(
                f"  replayed reserved peak, first / second: n={len(r)}  median {r.median():.4f}  max "
                f"{r.max():.4f}  min {r.min():.4f}  apart by > 1 %: {((r - 1).abs() > 0.01).mean():.1%}"
            )
    for k in ("1", "2"):
        col = f"sim_peak_allocated_bytes_{k}"
        if col in both:
            s = (both[col] / both[f"peak_allocated_bytes_{k}"]).dropna()
            if not s.empty:
                print(
                    f"  replayed / measured allocated peak, dataset {k}: median {s.median():.4f}, "
                    f"min {s.min():.4f}, max {s.max():.4f}, below 0.98: {(s < 0.98).mean():.1%}"
                )


if __name__ == "__main__":
    main()
