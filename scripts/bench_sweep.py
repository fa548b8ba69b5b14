"""Benchmark: a sweep's overhead per point (Hydra composition, filtering, store) against run time.

Runs ``harness sweep +study=cpu_smoke`` into a fresh directory. Each record carries its point's own
wall time (``wall_s``: the supervisor's first fork to its last reap) and when its row was written
(``finished_at``); the time between two consecutive rows minus the later point's ``wall_s`` is what the
sweep spent around that point (composing its config, launching the job, building and writing the
record). Prints the median over points 2…n (the first also pays the one-time imports, shown apart) and
the whole sweep's wall time. Target (issue 4): under 0.5 s per point. Run: python scripts/bench_sweep.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from harness.sweep.store import load_results


def timed_sweep(results_dir: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "harness", "sweep", "+study=cpu_smoke", f"results_dir={results_dir}"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        wall = timed_sweep(tmp)
        frame, bad = load_results(tmp)
    assert not bad and set(frame["status"]) == {"ok"}, (bad, frame["status"].tolist())
    frame = frame.sort_values("finished_at").reset_index(drop=True)
    gaps = (frame["finished_at"].diff() - frame["wall_s"])[1:]
    first = frame["finished_at"][0] - start - frame["wall_s"][0]
    overhead = float(gaps.median())
    print(
        f"cpu_smoke: {len(frame)} points, sweep wall {wall:.1f} s, points' own wall "
        f"{frame['wall_s'].sum():.1f} s (median point {frame['wall_s'].median():.2f} s)"
    )
    print(
        f"before the first point (interpreter, imports, composing and filtering every point): {first:.1f} s"
    )
    print(
        f"overhead per point, median of points 2-{len(frame)}: {overhead:.3f} s (min {gaps.min():.3f}, "
        f"max {gaps.max():.3f}); target < 0.5 s -> {'met' if overhead < 0.5 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
