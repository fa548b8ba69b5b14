"""`harness results status|compact` and `harness report`: the commands that read a results_dir."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from harness.cli.config import compose, engine_name


def results_command(args: Sequence[str]) -> int:
    """`harness results status|compact [results_dir=DIR]`."""
    from harness.sweep.progress import leftover_points, what_is_left
    from harness.sweep.store import compact, load_results, status_counts

    action = args[0] if args and "=" not in args[0] else "status"
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = set(opts) - {"results_dir"}
    if unknown or action not in ("status", "compact"):
        raise ValueError(f"usage: harness results status|compact [results_dir=DIR] (got {list(args)})")
    root = opts.get("results_dir", "results")
    if not os.path.isdir(root):  # compact would create it; status would count nothing (issue 12)
        raise ValueError(f"results_dir={root} is not a directory")
    if action == "compact":
        path, n, bad = compact(root)
        print(f"{n} runs → {path}")
    else:
        frame, bad = load_results(root, columns=["config_id", "status"])  # only what it counts
        counts = status_counts(frame)
        print(
            f"{root}: {len(frame)} runs: "
            + (", ".join(f"{s} {n}" for s, n in counts.most_common()) or "none")
        )
        ids = set(frame["config_id"]) if "config_id" in frame else set()
        for line in (what_is_left(root, ids), leftover_points(root)):
            if line:
                print(line)
    for line in bad:
        print(f"unreadable: {line}", file=sys.stderr)
    return 0


def report_command(overrides: Sequence[str]) -> int:
    from harness.analysis.report import write_report

    cfg = compose(overrides)
    root = str(cfg["results_dir"])
    frame = load_runs(root)
    path = write_report(
        frame,
        out_dir=cfg["report"]["out"] or root,
        results_dir=root,
        engine=engine_name(cfg),
        group_by=str(cfg["calibrate"]["group_by"]),
    )
    print(f"report: {path}")
    return 0


def load_runs(root: str):
    """The runs of ``root`` (unreadable files named on stderr); a missing or empty directory is an error."""
    from pathlib import Path

    from harness.sweep.store import load_results

    if not Path(root).is_dir():
        raise ValueError(f"results_dir={root} is not a directory")
    frame, bad = load_results(root)
    for line in bad:
        print(f"unreadable: {line}", file=sys.stderr)
    if frame.empty:
        raise ValueError(f"results_dir={root} holds no runs")
    return frame
