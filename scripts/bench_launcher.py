"""Benchmark: per-point wall time of the fork supervisor against one `torchrun` per point.

For 2, 4 and 8 ranks, the same point (model tiny, FP32, sequence 64, data parallel over every rank,
2 steps) runs three times each way; the script prints the median wall time of each and their ratio.
Target (issue 3): the supervisor at least 2× faster at 8 ranks. Run: python scripts/bench_launcher.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.cli.config import compose, run_spec
from harness.runner.supervisor import run_point
from harness.spec import canonical


def torchrun_point(spec, world: int, timeout_s: float) -> float:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(dataclasses.asdict(spec)))
        start = time.perf_counter()
        subprocess.run(
            [
                torchrun,
                "--standalone",
                f"--nproc_per_node={world}",
                "-m",
                "harness.runner.torchrun_entry",
                str(spec_file),
                tmp,
                str(timeout_s),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s + 60,
        )
        wall = time.perf_counter() - start
        codes = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        assert all("error" not in c for c in codes), codes
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    print(f"{'ranks':>5} {'fork s':>8} {'torchrun s':>11} {'torchrun/fork':>14}")
    for world in args.worlds:
        spec = canonical(
            run_spec(
                compose(
                    [
                        "model=tiny",
                        "train.precision=fp32",
                        "train.seq_len=64",
                        "train.steps=2",
                        f"parallel.dp={world}",
                    ]
                )
            )
        )
        fork, trun = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            record = run_point(spec, timeout_s=300)
            fork.append(time.perf_counter() - start)
            assert record["status"] == "ok", record["error"]
            trun.append(torchrun_point(spec, world, 300))
        f, t = statistics.median(fork), statistics.median(trun)
        print(f"{world:>5} {f:>8.2f} {t:>11.2f} {t / f:>13.2f}×", flush=True)


if __name__ == "__main__":
    main()
