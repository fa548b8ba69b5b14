"""Hold every fake run to the real run of the same point (issue 30 item 4): for each config_id run both
ways (status ok in both), each traced rank's allocated peak against the same rank's measured peak, and
each traced rank's replayed reserved peak against the same rank's replay of the real run (rows with
``per_rank_sim_reserved_bytes``; older rows: the point's highest replayed peak each way). Prints the share of
points within the issue's goals (allocated within 0.5 %, reserved within 1 %) and names every point
outside them, worst first.
Run: python scripts/fake_vs_real.py REAL_RESULTS_DIR FAKE_RESULTS_DIR
"""

from __future__ import annotations

import sys

import pandas as pd

from harness.analysis.report import layout_label
from harness.sweep.store import load_results

ALLOCATED_GOAL, RESERVED_GOAL = 0.005, 0.01


def compare(real: pd.DataFrame, fake: pd.DataFrame) -> pd.DataFrame:
    """One row per point run both ways: the worst relative gap of a traced rank's allocated peak, the
    rank it is on, and the relative gap of the replayed reserved peak (fake minus real, over real)."""
    columns = [
        "fake_traced_ranks",
        "per_rank_peak_bytes",
        "sim_peak_reserved_bytes",
        "per_rank_sim_reserved_bytes",
    ]
    for frame in (real, fake):
        if "per_rank_sim_reserved_bytes" not in frame:
            frame["per_rank_sim_reserved_bytes"] = None
    traced = fake.loc[fake["status"] == "ok", ["config_id", *columns]]
    traced = traced.rename(columns={c: f"{c}_fake" for c in columns})
    both = real[real["status"] == "ok"].merge(traced, on="config_id", validate="one_to_one")
    out = []
    for _, r in both.iterrows():
        measured = list(r["per_rank_peak_bytes"])
        traced = dict(zip(r["fake_traced_ranks_fake"], r["per_rank_peak_bytes_fake"], strict=True))
        gaps = {rank: (peak - measured[rank]) / measured[rank] for rank, peak in traced.items()}
        rank = max(gaps, key=lambda k: abs(gaps[k]))
        reserved = _reserved_gap(r)
        out.append(
            {
                "config_id": r["config_id"],
                "layout": layout_label(r),
                "allocated_gap": gaps[rank],
                "rank": int(rank),
                "reserved_gap": reserved,
            }
        )
    return pd.DataFrame(out)


def _reserved_gap(r: pd.Series) -> float:
    """The fake replay's reserved peak against the real one's (fake minus real, over real): the traced
    rank furthest from the same rank of the real run where both rows have each rank's, else the two
    rows' highest replayed peaks."""
    real_ranks, fake_ranks = r["per_rank_sim_reserved_bytes"], r["per_rank_sim_reserved_bytes_fake"]
    if real_ranks is not None and fake_ranks is not None:
        pairs = [
            (fake, real_ranks[rank])
            for rank, fake in zip(r["fake_traced_ranks_fake"], fake_ranks, strict=True)
            if fake is not None and real_ranks[rank] is not None
        ]
        if pairs:
            return max(((f - m) / m for f, m in pairs), key=abs)
    real_reserved = r["sim_peak_reserved_bytes"]
    return (r["sim_peak_reserved_bytes_fake"] - real_reserved) / real_reserved


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/fake_vs_real.py REAL_RESULTS_DIR FAKE_RESULTS_DIR")
    (real, _), (fake, _) = load_results(sys.argv[1]), load_results(sys.argv[2])
    c = compare(real, fake)
    if c.empty:
        sys.exit("no point is ok both real and fake")
    alloc_ok = c["allocated_gap"].abs() <= ALLOCATED_GOAL
    reserved_known = c["reserved_gap"].notna()
    res_ok = c["reserved_gap"].abs() <= RESERVED_GOAL
    print(f"{len(c)} points ok both real and fake ({len(real)} real rows, {len(fake)} fake rows)")
    print(
        f"allocated peak, every traced rank within {ALLOCATED_GOAL:.1%}: {alloc_ok.sum()} of {len(c)}; "
        f"median |gap| {c['allocated_gap'].abs().median():.3%}, worst {c['allocated_gap'].abs().max():.2%}"
    )
    print(
        f"replayed reserved peak within {RESERVED_GOAL:.0%}: {(res_ok & reserved_known).sum()} of "
        f"{reserved_known.sum()} with both replays; median |gap| {c['reserved_gap'].abs().median():.3%}, "
        f"worst {c['reserved_gap'].abs().max():.2%}"
    )
    outside = c[~alloc_ok | (reserved_known & ~res_ok)]
    if len(outside):
        print("\noutside the goals (fake minus real, over real), worst first:")
        worst = outside[["allocated_gap", "reserved_gap"]].abs().max(axis=1)
        order = worst.sort_values(ascending=False).index
        for _, r in outside.loc[order].iterrows():
            print(
                f"  {r['config_id']}  allocated {r['allocated_gap']:+.2%} (rank {r['rank']})  "
                f"reserved {r['reserved_gap']:+.2%}  {r['layout']}"
            )


if __name__ == "__main__":
    main()
