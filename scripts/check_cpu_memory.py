"""Check: the runner's CPU peak (the allocator's running total) against PyTorch's MemTracker.

Since the runner records the CPU allocator's own running total as ``peak_allocated_bytes`` (torch.profiler
with ``profile_memory=True``, plus every storage alive at the start of the measured step) and MemTracker's
peak beside it (``tracker_peak_bytes``, whose categories say what the peak is made of), this prints both
for each rank of a single-rank, an FSDP (ZeRO-3), a DDP (ZeRO-0), a DDP + ZeRO-1 and a TP + SP point, and
the relative difference. Exits 1 if any differs by more than the tolerance (2 %, issue 3). (Runs 1-4 in
results/runner_checks/cpu_memory_vs_profiler.txt excused DDP's 8.5-9.3 % as buckets "rebuilt out of
MemTracker's sight": it was the allocator count that was wrong, harness/runner/measure
``start_cpu_accounting``; no difference is excused now.)
Run: python scripts/check_cpu_memory.py [--tolerance 0.02] [--point NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness.cli.config import compose, run_spec
from harness.runner.supervisor import run_point

POINTS = {
    "single rank": [],
    "FSDP dp2 zero3": ["parallel.dp=2", "parallel.zero_stage=3"],
    "DDP dp2 zero0": ["parallel.dp=2", "parallel.zero_stage=0"],
    "DDP dp2 zero1": ["parallel.dp=2", "parallel.zero_stage=1"],
    "TP tp2 + SP": ["parallel.tp=2"],
}
COMMON = [
    "model=small",
    "train.precision=fp32",
    "train.seq_len=256",
    "train.micro_batch_size=4",
    "train.steps=3",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--point", action="append", choices=list(POINTS), help="only these (default: all)")
    args = ap.parse_args()
    worst = 0.0
    print(f"{'point':<16} {'rank':>4} {'MemTracker MiB':>15} {'allocator MiB':>14} {'diff':>7}")
    for name, overrides in POINTS.items():
        if args.point and name not in args.point:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            record = run_point(run_spec(compose(COMMON + overrides)), timeout_s=600, keep_dir=Path(tmp))
            if record["status"] != "ok":
                print(f"{name}: {record['status']} {record['error']}")
                return 1
            for rank in range(len(record["per_rank_peak_bytes"])):
                r = json.loads((Path(tmp) / f"rank{rank}.json").read_text())
                tracked, truth = r["tracker_peak_bytes"], r["peak_allocated_bytes"]
                diff = (tracked - truth) / truth
                worst = max(worst, abs(diff))
                mib = f"{tracked / 2**20:>15.2f} {truth / 2**20:>14.2f}"
                print(f"{name:<16} {rank:>4} {mib} {diff:>+7.2%}")
    verdict = "within" if worst <= args.tolerance else "OUTSIDE"
    print(f"largest difference {worst:.2%}: {verdict} the {args.tolerance:.0%} tolerance")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
