"""Benchmark: how many configurations per second `harness plan` evaluates.

Times plan() over every layout of 1,024 GPUs for Llama-3-70B (sequence 8192, H100 80 GB; the
default plan options: micro-batch 1/2/4/8, ZeRO 0–3, recompute none/selective/full, 1F1B and
interleaved) and prints the median of the repeats, configurations per second, and the target
(under one second). Run: python scripts/bench_plan.py [--repeats 5] [--gpus 1024]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time

from harness.cli.config import compose, run_spec
from harness.estimate.plan import PlanOptions, plan


def clear_caches() -> None:
    """Empty every lru_cache of the estimator's modules: each repeat starts as a new process would."""
    for name, module in list(sys.modules.items()):
        if name.startswith(("harness.estimate", "harness.spec")):
            for obj in vars(module).values():
                if callable(getattr(obj, "cache_clear", None)):
                    obj.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--model", default="llama3_70b")
    args = ap.parse_args()

    base = run_spec(compose([f"model={args.model}", "device=h100_80gb", "train.seq_len=8192"]))
    opts = PlanOptions(gpus=args.gpus)
    times = []
    for _ in range(args.repeats):
        # Each repeat is a fresh `harness plan` invocation's work: cold caches, and the previous
        # result released (alive, its ~10^5 objects would make every garbage-collection pass slower).
        clear_caches()
        result = None
        gc.collect()
        start = time.perf_counter()
        result = plan(base, opts)
        times.append(time.perf_counter() - start)
    med = statistics.median(times)
    print(f"plan: {args.model}, {args.gpus} GPUs (h100_80gb, seq 8192)")
    print(
        f"  layouts considered {result.considered}, impossible {result.invalid}, "
        f"valid (estimated) {len(result.rows)}, fitting {len(result.fitting)}"
    )
    print(
        f"  wall time per plan: median {med:.3f} s over {args.repeats} runs "
        f"(min {min(times):.3f}, max {max(times):.3f})"
    )
    print(
        f"  configurations per second: {result.considered / med:,.0f} considered, "
        f"{len(result.rows) / med:,.0f} estimated"
    )
    print(f"  target: all layouts in under 1 s -> {'met' if med < 1.0 else 'NOT met'}")

    # The whole command as a user runs it: interpreter start, imports, Hydra composition, plan, output.
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "plan",
        f"model={args.model}",
        "device=h100_80gb",
        "train.seq_len=8192",
        f"plan.gpus={args.gpus}",
        "format=json",
    ]
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    print(f"  `harness plan ... format=json` end to end: median {wall:.2f} s over 3 runs")
    print(f"  target (issue 32): the whole command under 2 s -> {'met' if wall < 2.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
