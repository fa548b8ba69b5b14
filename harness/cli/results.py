"""`harness results status|compact` and `harness report`: the commands that read a results_dir."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

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


def writable_target(path: str, key: str, *, directory: bool) -> Path:
    """Where a command will write, checked before its work (issue 29: report.out= a file and
    calibrate.profile= a directory or a path under a file ended in tracebacks after the fit): a
    directory (``directory``) or a file, and nothing on the way a file."""
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise ValueError(f"{key}={path} is a file; name a directory")
    if not directory and target.is_dir():
        raise ValueError(f"{key}={path} is a directory; name a file (e.g. {target / 'calibration.json'})")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{key}={path} is under {parent}, which is a file")
            break
    return target


def report_command(overrides: Sequence[str]) -> int:
    from harness.analysis.report import write_report

    cfg = compose(overrides)
    roots = results_dirs(cfg)
    out_dir = cfg["report"]["out"] or roots[0]
    if len(roots) > 1 and not cfg["report"]["out"]:
        raise ValueError(
            "calibrate.also_results: name report.out= (a report of several directories is not "
            f"{roots[0]}'s own)"
        )
    writable_target(str(out_dir), "report.out", directory=True)
    frame = load_runs(roots)
    path = write_report(
        frame,
        out_dir=out_dir,
        results_dir=roots[0],
        also_results=roots[1:],
        engine=engine_name(cfg),
        group_by=str(cfg["calibrate"]["group_by"]),
    )
    print(f"report: {path}")
    return 0


def results_dirs(cfg: dict) -> list[str]:
    """``results_dir`` and the directories of ``calibrate.also_results``, in that order, each once."""
    also = cfg["calibrate"].get("also_results") or []
    if isinstance(also, str) or not all(isinstance(d, str) for d in also):
        raise ValueError(f"calibrate.also_results={also!r} must be a list of directories, e.g. [DIR,DIR]")
    return list(dict.fromkeys([str(cfg["results_dir"]), *also]))


def load_runs(roots: str | Sequence[str]):
    """The runs of one results directory or several (unreadable files named on stderr); a missing
    directory, or none holding a run, is an error. Several directories' rows are one frame (a point run
    in two of them counts twice: each row is a run)."""
    from pathlib import Path

    import pandas as pd

    from harness.sweep.store import load_results

    roots = [roots] if isinstance(roots, str) else list(roots)
    key = "results_dir" if len(roots) == 1 else "results_dir/calibrate.also_results"
    frames = []
    for root in roots:
        if not Path(root).is_dir():
            raise ValueError(f"{key}: {root} is not a directory")
        frame, bad = load_results(root)
        for line in bad:
            print(f"unreadable: {line}", file=sys.stderr)
        frames.append(frame)
    frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
    frame, unusable = usable_runs(frame)
    for line in unusable:
        print(f"unusable: {line}", file=sys.stderr)
    if frame.empty:
        raise ValueError(f"results_dir={' + '.join(roots)} holds no runs")
    return frame


def usable_runs(frame):
    """The rows ``calibrate`` and ``report`` can use, and one line naming each other row with its
    reason (issue 29: one row with a null ``parallel_dp`` or an infinite peak ended both in a
    traceback). A launched row must hold a canonical spec, as every writer stores it, and a finite
    peak where it has one; ``invalid`` rows are kept as they are (they are counted, never fitted)."""
    import math

    from harness.spec import InvalidSpec, canonical, from_flat

    keep, reasons = [], []
    for i, row in zip(frame.index, frame.to_dict("records"), strict=True):
        if row.get("status") == "invalid":
            keep.append(i)
            continue
        why = None
        try:
            spec = from_flat(row)
            if canonical(spec) != spec:
                why = "its spec is not in canonical form (a field is missing or null)"
        except (InvalidSpec, TypeError, ValueError) as exc:
            why = f"its spec does not load ({exc})"
        peak = row.get("peak_allocated_bytes")
        if why is None and isinstance(peak, float) and not math.isnan(peak) and not math.isfinite(peak):
            why = f"peak_allocated_bytes={peak}"
        if why is None:
            keep.append(i)
        else:
            reasons.append(f"{row.get('config_id')} (status {row.get('status')}): {why}; left out")
    return frame.loc[keep], reasons
