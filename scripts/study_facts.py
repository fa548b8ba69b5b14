"""Print the CPU study's figures that README.md quotes beyond report.md: total run time, the best
throughput per rank of the runs using each axis, by model and world size (GFLOP/s), the runs the
torch engine under-predicts most, the share within 2 % under-prediction (issue 15's goal), and, where
the rows carry them, the replayed reserved peaks (sim_peak_reserved_bytes) against the allocated ones,
and every pipeline stage's most-loaded rank against the engine's figure for that stage (issue 30).
Run: python scripts/study_facts.py [results/cpu_study/dataset.parquet | a results_dir]
"""

from __future__ import annotations

import sys

import pandas as pd

from harness.analysis.calibrate import prepare
from harness.analysis.report import layout_label


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "results/cpu_study/dataset.parquet"
    if path.endswith(".parquet"):
        f = pd.read_parquet(path)
    else:
        from harness.sweep.store import load_results

        f, _ = load_results(path)
    print(f"{len(f)} rows; run time {f['wall_s'].sum() / 60:.0f} min (sum of wall_s)")
    print(f"memory_method: {f['memory_method'].value_counts().to_dict()}")
    ok = f[f["status"] == "ok"]
    print("model  ranks  best GFLOP/s per rank: dp only | using tp | using pp | using cp")
    for (model, world), g in ok.groupby(["model_name", "parallel_world_size"]):
        dp_only = g[(g["parallel_tp"] == 1) & (g["parallel_pp"] == 1) & (g["parallel_cp"] == 1)]
        best = [
            frame["tflops_per_device"].max() * 1e3
            for frame in (dp_only, g[g["parallel_tp"] > 1], g[g["parallel_pp"] > 1], g[g["parallel_cp"] > 1])
        ]
        print(f"{model:<6} {int(world):>5}  " + " | ".join(f"{b:8.1f}" for b in best))
    data = prepare(f)  # the runs with a known outcome and every engine's estimate of them
    measured = data.frame["peak_allocated_bytes"].to_numpy(dtype=float)
    error = (data.raw_bytes["torch"] - measured) / measured
    print("most under-predicted by the torch engine: error, measured MiB, model, layout")
    m = data.measured
    for i in [i for i in error.argsort() if m[i]][:8]:
        row = data.frame.iloc[i]
        print(f"{error[i]:+7.1%} {measured[i] / 2**20:8.1f}  {row['model_name']:<6} {layout_label(row)}")
    under = -error[m]
    print(
        f"under-prediction: {(under <= 0.02).mean():.1%} of {int(m.sum())} measured runs within 2 %, "
        f"{(under > 0.05).sum()} worse than 5 %, worst {under.max():.1%}"
    )
    from harness.analysis.stages import partition_errors, stage_errors, summary

    print("every pipeline stage (its most-loaded rank against the torch engine's stage figure):")
    for r in summary(stage_errors(data)):
        print(
            f"  {r['position']:<6} {r['stages']:4d} stages: median {r['median']:+.2%}, p95 |err| "
            f"{r['p95_abs']:.2%}, worst under {r['worst_under']:.2%}, within 2 % under "
            f"{r['within_2pct_under']:.1%}"
        )
    partitions = partition_errors(data)
    if len(partitions):
        r = summary(partitions)[0]
        print(
            "every ZeRO-1 partition (each rank against the engine's figure for its partition): "
            f"{r['stages']} ranks, median {r['median']:+.2%}, p95 |err| {r['p95_abs']:.2%}, worst under "
            f"{r['worst_under']:.2%}, within 2 % under {r['within_2pct_under']:.1%}"
        )
    if "sim_peak_reserved_bytes" in data.frame:
        sim = data.frame["sim_peak_reserved_bytes"].to_numpy(dtype=float)
        ratio = (sim / measured)[m & (sim > 0)]
        print(
            f"replayed reserved / measured allocated: median {pd.Series(ratio).median():.3f}, "
            f"p95 {pd.Series(ratio).quantile(0.95):.3f} ({len(ratio)} runs)"
        )
        alloc = data.frame["sim_peak_allocated_bytes"].to_numpy(dtype=float)
        own = pd.Series((alloc / measured)[m & (alloc > 0)])
        print(
            f"replayed allocated / measured allocated: median {own.median():.4f}, below 0.98 on "
            f"{(own < 0.98).mean():.1%} of runs, min {own.min():.3f}, max {own.max():.3f}"
        )


if __name__ == "__main__":
    main()
