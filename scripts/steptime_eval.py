"""How well the step-time model ranks layouts on a study, held out, against plan's old proxy (issue 17).

    .venv/bin/python scripts/steptime_eval.py [results_dir] [--group-by world|model|layout]
        [--without TERM,...]

Reads the study (default results/cpu_study; read-only, no profile is written) and prints, per (model,
world size) group of runs that fit: the Spearman correlation of predicted and measured tokens/s and the
top-1 ratio (measured tokens/s of the layout predicted fastest / best measured), for
- the fitted step-time model, each run predicted by a fit that never saw its group (``harness calibrate``'s
  figures), and the same fit in sample (an upper bound: what the terms can express at all);
- plan's earlier proxy (harness.estimate.comm.cost: compute at peak + bubble + every collective
  serialised), evaluated with the run's own reference TFLOP/s and a 1 GB/s link, as issue 17 measured it.
Then the fitted terms, and the measured step-time spread where the study recorded one. With
``--repeat DIR`` (the same points run again into another directory), the noise ceiling: the same
figures with the second run's measurement as the "prediction" of the first, which no model can beat.
With ``--without ep,ep_latency`` (say), the same figures from a fit without those terms: what they add.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
import pandas as pd

from harness.analysis.steptime import StepTimeCalibrator, evaluate_step_time, ranking
from harness.estimate.comm import cost
from harness.estimate.steptime import TERMS
from harness.spec import from_flat
from harness.sweep.store import load_results


def proxy_step_times(runs: pd.DataFrame) -> np.ndarray:
    """The old ranking proxy per run, with the run's measured reference TFLOP/s and 1 GB/s links."""
    out = []
    for row in runs.to_dict("records"):
        s = from_flat(row)
        dev = dataclasses.replace(
            s.device, peak_tflops=float(row["mfu_reference_tflops"]), intra_node_gbps=1.0, inter_node_gbps=1.0
        )
        out.append(cost(dataclasses.replace(s, device=dev)).step_time_s)
    return np.array(out)


def summary(name: str, groups: pd.DataFrame) -> str:
    return (
        f"{name:<30} Spearman median {groups['spearman'].median():.3f} (min {groups['spearman'].min():.2f}), "
        f"top-1 median {groups['top1_ratio'].median():.1%} (min {groups['top1_ratio'].min():.1%})"
    )


def noise_ceiling(runs: pd.DataFrame, again: pd.DataFrame) -> str:
    """The ranking figures of a second measurement of the same points (matched by config_id) taken as
    the prediction of the first, and the median relative difference of the two step times."""
    second = again[again["status"] == "ok"].set_index("config_id")["step_time_s"]
    both = runs[runs["config_id"].isin(second.index)]
    if both.empty:
        return "--repeat: no point of the study was run again"
    repeat = second.loc[both["config_id"]].to_numpy(dtype=float)
    first = both["step_time_s"].to_numpy(dtype=float)
    diff = np.abs(repeat - first) / ((repeat + first) / 2)
    return (
        f"{len(both)} points run twice: step times differ by {np.median(diff):.1%} (median), "
        f"p90 {np.percentile(diff, 90):.1%}\n"
        + summary("noise ceiling (run 2 vs run 1)", ranking(both, repeat))
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", default="results/cpu_study")
    ap.add_argument("--group-by", default="world", choices=("world", "model", "layout"))
    ap.add_argument("--repeat", help="a results directory with the same points run again")
    ap.add_argument("--without", default="", help="terms left out of the fit, comma-separated")
    args = ap.parse_args(argv)
    without = tuple(t for t in args.without.split(",") if t)
    frame, bad = load_results(args.results_dir)
    for line in bad:
        print(f"unreadable: {line}", file=sys.stderr)
    st = evaluate_step_time(frame, group_by=args.group_by, without=without)
    if st is None:
        print(f"{args.results_dir}: too few timed runs to fit a step-time model")
        return 1
    m, runs = st.metrics, st.frame
    ok = (runs["status"] == "ok").to_numpy()
    print(
        f"{args.results_dir}: {m['fit_runs']} timed runs fitted (ok + simulated out-of-memory), "
        f"{m['judged_runs']} that fit judged; held out by {args.group_by} ({len(st.fold_coefs)} folds)"
        + (f"; without {', '.join(without)}" if without else "")
    )
    held = pd.DataFrame(m["groups"])
    print(f"held-out step time: median APE {m['median_ape']:.1%}, p95 {m['p95_ape']:.1%}")
    print(summary("fitted model, held out", held))
    X = runs[[f"st_{k}" for k in TERMS]].to_numpy(dtype=float)
    y = runs["step_time_s"].to_numpy(dtype=float)
    in_sample = StepTimeCalibrator().fit(X, y).predict(X)
    print(summary("fitted model, in sample", ranking(runs[ok], in_sample[ok])))
    all_timed = ranking(runs, runs["predicted_step_time_s"].to_numpy())
    print(summary("held out, judged on all timed", all_timed))
    if "mfu_reference_tflops" in runs and runs.loc[ok, "mfu_reference_tflops"].notna().all():
        proxy = proxy_step_times(runs[ok])
        print(summary("old proxy (issue 17)", ranking(runs[ok], proxy)))
    print()
    print(held.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print()
    print("fitted on every timed run:")
    for line in st.model.describe():
        print(f"  {line}")
    if args.repeat:
        again, _ = load_results(args.repeat)
        print("\n" + noise_ceiling(runs[ok], again))
    if "step_time_spread" in runs and runs["step_time_spread"].notna().any():
        spread = runs.loc[ok, "step_time_spread"].dropna()
        print(
            f"\nstep_time_spread over {len(spread)} runs that fit: median {spread.median():.1%}, "
            f"p90 {spread.quantile(0.9):.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
