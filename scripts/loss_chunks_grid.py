"""The chunked loss at full size: points of the H100 paper grid (`results/paper_fake/h100_94gb`, those
that ran) traced again with torchtitan's 8 slices (``train.loss_chunks=8``, every other choice the
row's), against the ``torch`` engine's allocated level and its reserved level raw and with the grid's
profile. A seeded shuffle picks the points; about 10 s a point.

Run: python scripts/loss_chunks_grid.py [SEED] [POINTS]   (docs/stacks.md: 0 24)
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys

import pandas as pd

from harness.analysis.profile import load_profile
from harness.estimate import estimate
from harness.runner.fake.run import run_fake
from harness.spec import canonical, from_flat

GRID = "results/paper_fake/h100_94gb"


def main(seed: int, points: int) -> None:
    d = pd.read_parquet(f"{GRID}/dataset.parquet")
    rows = d[d.status == "ok"].to_dict("records")
    random.Random(seed).shuffle(rows)
    profile = load_profile(f"{GRID}/calibration.json")
    errors: dict[str, list[float]] = {"allocated": [], "raw reserved": [], "calibrated reserved": []}
    for row in rows:
        if len(errors["allocated"]) >= points:
            break
        s = from_flat(row)
        s = canonical(dataclasses.replace(s, train=dataclasses.replace(s.train, loss_chunks=8)))
        r = run_fake(s)
        if r["status"] != "ok" or not r.get("sim_peak_reserved_bytes"):
            print(f"{row['model_name']}: {r['status']} {(r.get('error') or '')[:100]}", flush=True)
            continue
        e = estimate(s)
        replay = r["sim_peak_reserved_bytes"]
        got = {
            "allocated": (e.total_bytes / r["peak_allocated_bytes"] - 1) * 100,
            "raw reserved": (e.reserved_total_bytes / replay - 1) * 100,
            "calibrated reserved": (profile.reserved_bytes(e) / replay - 1) * 100,
        }
        for k, v in got.items():
            errors[k].append(v)
        p, t = s.parallel, s.train
        print(
            f"{row['model_name']} tp{p.tp} pp{p.pp} dp{p.dp} zero{p.zero_stage} {t.recompute} "
            f"mb{t.micro_batch_size} m{t.num_microbatches}: "
            + ", ".join(f"{k} {v:+.1f} %" for k, v in got.items()),
            flush=True,
        )
    for k, v in errors.items():
        print(
            f"{k} ({len(v)} points): median {statistics.median(v):+.1f} %, "
            f"from {min(v):+.1f} % to {max(v):+.1f} %"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 24)
