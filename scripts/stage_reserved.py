"""The engine's reserved level of every traced rank's own stage against that rank's replayed reserved
peak (issue 32): where a mechanism is missing, per stage rather than per run (a run's reserved peak is
its worst rank's, which hides the other stages).

For each fake-traced point of the given results directories (``fake_traced_ranks``,
``per_rank_sim_reserved_bytes``), each traced rank is mapped to its pipeline stage (pp is the outermost
mesh dimension: stage = rank // (world / pp)), and the ``torch`` engine's reserved level of that stage
(allocated peak plus the reserved terms, without the cuBLAS workspace, which a trace lacks) is compared
with the rank's replayed reserved peak. Prints the error by kind of stage (first, middle, last; with and
without tensor parallelism), then the largest misses.

  python scripts/stage_reserved.py results/paper_fake/h100_94gb results/paper_fake/extended [--top 15]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.calibrate import prepare
from harness.estimate import estimate

GIB = 1 << 30


def stage_rows(results_dir: Path) -> list[dict]:
    """One row per traced rank of every point of ``results_dir`` that has per-rank replays."""
    data = prepare(pd.read_parquet(results_dir / "dataset.parquet"))
    rows = []
    for i, s in enumerate(data.specs):
        row = data.frame.iloc[i]
        ranks, replayed = row.get("fake_traced_ranks"), row.get("per_rank_sim_reserved_bytes")
        if ranks is None or replayed is None or len(ranks) != len(replayed):
            continue
        p = s.parallel
        est = estimate(s)
        by_stage = {st.stage: st for st in est.stages}
        for rank, target in zip(ranks, replayed, strict=True):
            stage = int(rank) // (p.world // p.pp)
            st = by_stage.get(stage)
            if st is None or not target:
                continue
            terms = est.reserved_terms(st)
            level = st.total_bytes + sum(v for k, v in terms.items() if k != "cublas_workspace")
            kind = "last" if stage == p.pp - 1 else ("first" if stage == 0 else "middle")
            rows.append(
                {
                    "dir": results_dir.name,
                    "config_id": row["config_id"],
                    "model": s.model.name,
                    "layout": f"tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp} zero{p.zero_stage} "
                    f"mbs{s.train.micro_batch_size} {s.train.recompute} {p.pp_schedule}",
                    "pp": p.pp,
                    "tp": p.tp,
                    "stage": stage,
                    "kind": kind if p.pp > 1 else "only",
                    "error": (level - float(target)) / float(target),
                    "gap_gib": (float(target) - level) / GIB,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15, help="the largest misses to list")
    args = ap.parse_args()
    rows = pd.DataFrame([r for d in args.results_dirs for r in stage_rows(d)])
    if rows.empty:
        raise SystemExit("no traced rank with a replayed reserved peak in these directories")
    # one row per distinct stage of a distinct configuration (the grids repeat layouts across cards)
    rows = rows.drop_duplicates(subset=["model", "layout", "stage"])
    rows["tensor parallel"] = np.where(rows["tp"] > 1, "tp > 1", "tp = 1")
    print(f"{len(rows)} traced stages; error = (engine reserved - replayed reserved) / replayed")
    summary = rows.groupby(["kind", "tensor parallel"])["error"].describe(percentiles=[0.05, 0.5, 0.95])
    table = summary[["count", "5%", "50%", "95%", "min", "max"]] * [1, 100, 100, 100, 100, 100]
    print(table.round(1).to_string())  # (percent, but the count)
    print(f"\nthe {args.top} largest under-predictions:")
    worst = rows.nsmallest(args.top, "error")
    for r in worst.itertuples():
        print(f"  {r.error:+7.1%}  {r.gap_gib:6.2f} GiB  {r.model:<12} {r.layout}  stage {r.stage}")


if __name__ == "__main__":
    main()
