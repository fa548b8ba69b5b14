"""Write the small results fixture the tests use (tests/fixtures/results_small/dataset.parquet) from a
compacted study: every run that ran out of memory plus an even sample of the others, at most ``--rows``
runs, chosen by sorted config_id (so the same study gives the same fixture), per-run columns kept as
they are. Run: python scripts/make_fixture.py results/cpu_study/dataset.parquet --rows 80
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "results_small" / "dataset.parquet"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--rows", type=int, default=80)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    frame = pd.read_parquet(args.dataset).sort_values("config_id", kind="stable").reset_index(drop=True)
    runs = frame[frame["status"].isin(["ok", "oom"])]
    oom = runs[runs["status"] == "oom"]
    oom = oom.iloc[:: max(1, len(oom) // (args.rows // 4))]  # a quarter of the fixture at most
    rest = runs[runs["status"] == "ok"]
    ok = rest.iloc[:: max(1, len(rest) // (args.rows - len(oom)))][: args.rows - len(oom)]
    others = frame[~frame["status"].isin(["ok", "oom"])].head(3)  # an invalid row or two, as a study has
    fixture = pd.concat([ok, oom, others]).sort_values("config_id", kind="stable")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fixture.to_parquet(args.out, index=False)
    print(f"{len(fixture)} runs ({fixture['status'].value_counts().to_dict()}) -> {args.out}")


if __name__ == "__main__":
    main()
