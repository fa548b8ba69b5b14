"""What a sweep says while it runs and when it ends: one line per finished point, what is left, and the
closing summary with the next commands."""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness.sweep.store import existing_ids, load_results


def closing_summary(results_dir: str, planned: list[str]) -> str:
    """The lines a sweep ends with (issue 16): counts by status of its points, the worst
    predicted-vs-measured ratios, where the rows are, and the next commands."""
    frame, bad = load_results(results_dir)
    lines = []
    if len(frame) and "config_id" in frame:
        mine = frame[frame["config_id"].isin(set(planned))]
        counts = Counter(mine["status"]) if "status" in mine else Counter()
        missing = len(set(planned)) - len(mine)
        lines.append(
            f"harness sweep: done: {len(set(planned))} points: "
            + ", ".join(f"{s} {n}" for s, n in counts.most_common())
            + (f", {missing} without a row (run the sweep again to resume)" if missing else "")
        )
        if {"peak_allocated_bytes", "est_total_bytes"} <= set(mine.columns):
            ok = mine[(mine["status"] == "ok") & (mine["peak_allocated_bytes"] > 0)]
            ratio = ok["est_total_bytes"] / ok["peak_allocated_bytes"]
            worst = ratio.apply(lambda r: max(r, 1 / r)).sort_values(ascending=False).index[:3]
            if len(worst):
                lines.append(
                    "harness sweep: worst predicted/measured peak (torch engine): "
                    + ", ".join(f"{ratio[i]:.2f} ({_layout(mine.loc[i])})" for i in worst)
                )
        shares = [(reserved_share(r), r) for _, r in mine.iterrows() if r.get("status") in ("ok", "oom")]
        shares = [(s, r) for s, r in shares if s is not None]
        if shares:
            (share, how), row = max(shares, key=lambda x: x[0][0])
            lines.append(f"harness sweep: worst reserved / capacity: {share:.1%} ({how}; {_layout(row)})")
    for line in bad:
        lines.append(f"harness sweep: unreadable: {line}")
    at = shlex.quote(f"results_dir={results_dir}")  # (issue 29: a path with spaces printed unquoted)
    lines.append(f"harness sweep: one row per point in {results_dir}; next:")
    lines.append(
        f"  harness results status {at}   (counts)   harness results compact {at}   (one dataset.parquet)"
    )
    lines.append(f"  harness calibrate {at}   (fit, safe threshold)   harness report {at}   (figures)")
    return "\n".join(lines)


def reserved_share(row) -> tuple[float, str] | None:
    """A GPU row's reserved peak over its device's capacity, and how it was obtained: ``measured`` (the
    CUDA allocator's) or ``replayed`` (the rank's trace through the allocator model); None without one
    or on the CPU."""
    capacity = row.get("device_memory_gib")
    if row.get("device_name") in (None, "cpu"):  # the CPU's capacity is a simulated one: not shown
        return None
    for key, how in (("peak_reserved_bytes", "measured"), ("sim_peak_reserved_bytes", "replayed")):
        value = row.get(key)
        if value is not None and value == value and capacity:  # (NaN: a missing cell)
            return float(value) / (float(capacity) * 2**30), how
    return None


def _layout(row) -> str:
    return (
        " ".join(
            f"{k[9:]}={row[k]}"
            for k in ("parallel_dp", "parallel_tp", "parallel_pp", "parallel_cp")
            if k in row
        )
        + f" zero={row.get('parallel_zero_stage')}"
    )


PLAN_FILE = ".sweep-plan.json"
DONE_FILE = ".sweep-done.log"


def start_progress(results_dir: str, *, name: str, launched: int, planned: list[str]) -> None:
    """Called by the sweeper before launching: the sweep's points (config_ids), how many it launches,
    since when; the done-log restarts. A sweep that launches nothing leaves both alone."""
    if launched == 0:
        return  # (issue 29: a sweep that launches nothing reset the running one's count to [1/0])
    root = Path(results_dir)
    root.mkdir(parents=True, exist_ok=True)
    plan = {"name": name, "launched": launched, "started": time.time(), "planned": planned}
    (root / PLAN_FILE).write_text(json.dumps(plan))
    (root / DONE_FILE).write_text("")


def read_plan(results_dir: str | Path) -> dict[str, Any] | None:
    """The last sweep's plan file, None where there is none or it is not one (issue 29: a malformed
    ``.sweep-plan.json`` was a traceback in ``results status`` and in every job's progress line)."""
    try:
        plan = json.loads((Path(results_dir) / PLAN_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    ok = (
        isinstance(plan, dict)
        and isinstance(plan.get("name"), str)
        and isinstance(plan.get("planned"), list)
        and all(isinstance(c, str) for c in plan["planned"])
        and isinstance(plan.get("launched"), int)
        and not isinstance(plan.get("launched"), bool)
        and isinstance(plan.get("started"), int | float)
        and not isinstance(plan.get("started"), bool)
    )
    return plan if ok else None


def what_is_left(results_dir: str, ids: set[str] | None = None) -> str | None:
    """``sweep cpu_smoke: 8 points, 6 with a row, 2 left`` for the last sweep started in the directory
    (None when no sweep was started there). ``ids``: the runs already read (else they are read)."""
    plan = read_plan(results_dir)
    if plan is None:
        return None
    planned = set(plan["planned"])
    done = planned & (existing_ids(results_dir) if ids is None else ids)
    left = len(planned) - len(done)
    return f"sweep {plan['name']}: {len(planned)} points, {len(done)} with a row, {left} left"


def leftover_points(results_dir: str) -> str | None:
    """A line about the shared directories multi-node points left behind (kept when a node's task never
    reported, for its ranks' logs); None when there are none."""
    root = Path(results_dir) / ".points"
    kept = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not kept:
        return None
    noun = "directory" if len(kept) == 1 else "directories"
    return (
        f"{len(kept)} multi-node point {noun} kept in {root} (rank logs of points a node never "
        f"reported on; delete them once read): {', '.join(kept[:3])}{' …' if len(kept) > 3 else ''}"
    )


def progress_line(results_dir: str, row: dict[str, Any], seconds: float) -> str:
    """``[3/12] ok dp=2 tp=1 pp=1 cp=1 zero=0 4.1 s | ok 2, oom 1 | about 35 s left``: one line per
    finished point. Jobs append their status to a log (one short O_APPEND write each: whole lines even
    with concurrent jobs)."""
    root = Path(results_dir)
    layout = " ".join(
        f"{k[9:]}={row[k]}" for k in ("parallel_dp", "parallel_tp", "parallel_pp", "parallel_cp") if k in row
    )
    head = f"{row['status']} {layout} zero={row.get('parallel_zero_stage')} {seconds:.1f} s"
    card = reserved_share(row)
    if card is not None:  # issue 31: the level that decides a GPU run, not only the tensors'
        share, how = card
        verdict = row.get("sim_capacity_verdict")
        head += f", reserved {share:.1%} of the card ({how})"
        if verdict not in (None, "fits"):
            head += f", {verdict.replace('_', ' ')}"
    plan = read_plan(root)
    if plan is None:
        return head
    try:
        with open(root / DONE_FILE, "a") as log:
            log.write(f"{row['status']}\n")
        statuses = (root / DONE_FILE).read_text().split()
    except (OSError, ValueError):
        return head
    done, total = len(statuses), plan["launched"]
    counts = ", ".join(f"{s} {n}" for s, n in Counter(statuses).most_common())
    elapsed = time.time() - plan["started"]
    left = f" | about {elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
    return f"[{done}/{total}] {head} | {counts}{left}"
