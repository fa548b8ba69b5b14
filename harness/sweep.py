"""Sweeps: which points of a Hydra grid to launch, the job that runs one point, and progress.

Nothing here imports torch; the job imports the runner when it runs a point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from harness.record import invalid_record
from harness.specs import InvalidSpec, canonical, from_dict, spec_id
from harness.store import existing_ids, record_path, write_record


def spec_of(cfg: dict[str, Any]):
    return from_dict({k: cfg.get(k) for k in ("model", "parallel", "train", "device")})


def point_id(cfg: dict[str, Any]) -> str:
    return spec_id(spec_of(cfg))


def triage(
    points: list, configs: list[dict[str, Any]], *, write: bool = True
) -> tuple[list[tuple[Any, dict]], str]:
    """Decide each composed point: launch it, or write its row now (invalid, predicted out of memory), or
    skip it (a result exists). Returns the points to launch and a one-line summary. ``write=False``
    (a dry run) decides the same and writes nothing."""
    from harness.estimate import estimate

    launch, counts = [], Counter()
    done_by_dir: dict[str, set[str]] = {}
    seen: set[tuple[str, str]] = set()  # (results_dir, id) of the points of this grid
    for point, cfg in zip(points, configs, strict=True):
        results_dir = cfg["results_dir"]
        done = done_by_dir.setdefault(results_dir, existing_ids(results_dir))
        try:
            spec = spec_of(cfg)
        except InvalidSpec as exc:  # an unknown key is the study file's mistake: stop, say which
            raise SystemExit(f"harness sweep: error: {exc}") from None
        cid = spec_id(spec)  # the spec is already built: no second from_dict
        if (results_dir, cid) in seen:  # two grids (or two spellings) of the same point: it runs once
            counts["duplicates"] += 1
            continue
        seen.add((results_dir, cid))
        if cid in done:
            counts["already done"] += 1
            continue
        try:
            spec = canonical(spec)
        except InvalidSpec as exc:
            if write:
                write_record(_tag(invalid_record(spec, str(exc)), cfg), results_dir)
            counts["invalid (row written)"] += 1
            continue
        sweep = cfg.get("sweep", {})
        if sweep.get("prune_predicted_oom"):
            est = estimate(spec, engine="torch")
            factor = float(sweep.get("prune_factor", 2.0))
            if est.utilisation > factor:
                row = invalid_record(
                    spec, f"estimate {est.utilisation:.2f}× capacity > prune_factor {factor}"
                )
                row["status"] = "skipped_predicted_oom"
                if write:
                    write_record(_tag(row, cfg), results_dir)
                counts["skipped, predicted out of memory (row written)"] += 1
                continue
        launch.append((point, cfg))
        counts["to launch"] += 1
    order = (
        "to launch",
        "already done",
        "duplicates",
        "invalid (row written)",
        "skipped, predicted out of memory (row written)",
    )
    summary = f"harness sweep: {len(points)} points: " + ", ".join(
        f"{counts[k]} {k}" for k in order if counts[k]
    )
    if not write:
        summary = summary.replace("(row written)", "(row not written: dry run)")
    return launch, summary


def nodes_for(cfg: dict[str, Any]) -> int | None:
    """How many nodes the point's job asks for: ``ceil(world / sweep.ranks_per_node)``; None when the
    study does not set ``ranks_per_node`` (the launcher's own ``nodes`` then holds for every point)."""
    per_node = cfg.get("sweep", {}).get("ranks_per_node")
    if per_node is None:
        return None
    if int(per_node) < 1:
        raise SystemExit(f"harness sweep: error: sweep.ranks_per_node={per_node}: must be >= 1 (or null)")
    return -(-canonical(spec_of(cfg)).parallel.world // int(per_node))


def _tag(row: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    row["sweep_name"] = cfg.get("sweep", {}).get("name")
    return row


class SlurmSignal(Exception):
    """Slurm signalled the job: its time limit is near (submitit's --signal=USR2@…) or it is ending."""


def _raise_slurm_signal(signum, frame):
    raise SlurmSignal(f"Slurm sent {signal.Signals(signum).name}: the job's time limit (or a preemption)")


def slurm_task(results_dir: str, cid: str):
    """Under a Slurm job of several tasks (a point wider than one node: ``nodes`` > 1, or
    ``tasks_per_node`` > 1, e.g. one task per GPU), this task's place among them; None otherwise.
    Works inside a submitit job and under a bare ``srun`` alike. Each task forks its block of the
    point's ranks; they meet at the job's first host (submitit's parser of Slurm's node list) on
    ``MASTER_PORT``, or a port drawn from the job id as submitit's TorchDistributedEnvironment draws
    it, and share a directory under ``results_dir`` (which a cluster's nodes all see: the rows go
    there too)."""
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: only srun sets it, so a batch script of a multi-task
    # allocation that runs `harness run` itself (not under srun) stays one task that forks every rank.
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) <= 1 or not os.environ.get("SLURM_JOB_ID"):
        return None
    import random

    # The Slurm environment directly: submitit's generic JobEnvironment() only answers inside a job
    # that submitit itself started.
    from submitit.slurm.slurm import SlurmJobEnvironment

    from harness.runner.supervisor import Task

    env = SlurmJobEnvironment()
    port = os.environ.get("MASTER_PORT")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Task(
        index=env.global_rank,
        count=env.num_tasks,
        master_addr=env.hostnames[0],
        port=int(port) if port else random.Random(env.job_id).randint(20000, 60000),
        # A requeued job keeps its id: the restart count keeps an earlier attempt's files apart.
        shared_dir=Path(results_dir) / ".points" / f"{cid}-{env.job_id}-{restarts}",
        tasks_per_node=env.num_tasks // env.num_nodes,
        node_task=env.local_rank,
    )


def run_job(cfg: dict[str, Any]) -> str:
    """One sweep point: run it and write exactly one row, whatever happens (never raises).

    Under Slurm, USR2 (sent ``signal_delay_s`` before the time limit) and TERM interrupt the point:
    its ranks are reaped and its row says ``timeout`` with the reason. (Left to submitit's own handler,
    the signal would surface as an unrelated requeue error.) In a job of several tasks every task runs
    its ranks and task 0 alone writes the row.
    """
    results_dir = cfg["results_dir"]
    cid = point_id(cfg)
    if record_path(results_dir, cid).exists():  # a second line of defence against double runs
        return "already done"
    start = time.monotonic()
    previous = {}
    if os.environ.get("SLURM_JOB_ID"):
        previous = {s: signal.signal(s, _raise_slurm_signal) for s in (signal.SIGUSR2, signal.SIGTERM)}
    task = None
    try:
        task = slurm_task(results_dir, cid)
        from harness.runner.fake import run_configured

        row = run_configured(spec_of(cfg), cfg["run"], task=task)  # run.mode: real or fake
    except Exception as exc:  # the supervisor failed or was interrupted: still one row
        row = invalid_record(spec_of(cfg), "")
        timeout = isinstance(exc, SlurmSignal)
        row.update(
            status="timeout" if timeout else "crash",
            error=str(exc) if timeout else f"supervisor: {type(exc).__name__}: {exc}",
            traceback=None if timeout else traceback.format_exc()[-2000:],
            wall_s=time.monotonic() - start,
            launch_tasks=task.count if task else 1,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if task is not None and task.index > 0:  # task 0 writes the point's row
        return f"task {task.index} of {task.count}: {row['status'] if row else 'ranks done'}"
    if task is not None and row["status"] == "timeout" and "Slurm sent" in (row["error"] or ""):
        shutil.rmtree(task.shared_dir, ignore_errors=True)  # the interrupted point's rank files
    row["config_id"] = cid
    row["finished_at"] = time.time()  # Unix time; gaps between points measure the sweep's overhead
    write_record(_tag(row, cfg), results_dir)
    print(progress_line(results_dir, row, time.monotonic() - start), flush=True)
    return row["status"]


PLAN_FILE = ".sweep-plan.json"
DONE_FILE = ".sweep-done.log"


def start_progress(results_dir: str, *, name: str, launched: int, planned: list[str]) -> None:
    """Called by the sweeper before launching: the sweep's points (config_ids), how many it launches,
    since when; the done-log restarts."""
    root = Path(results_dir)
    root.mkdir(parents=True, exist_ok=True)
    plan = {"name": name, "launched": launched, "started": time.time(), "planned": planned}
    (root / PLAN_FILE).write_text(json.dumps(plan))
    (root / DONE_FILE).write_text("")


def what_is_left(results_dir: str) -> str | None:
    """``sweep cpu_smoke: 8 points, 6 with a row, 2 left`` for the last sweep started in the directory
    (None when no sweep was started there)."""
    try:
        plan = json.loads((Path(results_dir) / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    planned = set(plan.get("planned", []))
    done = planned & existing_ids(results_dir)
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
    try:
        plan = json.loads((root / PLAN_FILE).read_text())
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
