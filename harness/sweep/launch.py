"""Sweeps: which points of a Hydra grid to launch and the job that runs one point (its claim, its row).

Nothing here imports torch; the job imports the runner when it runs a point.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from harness.runner.procs import SlurmSignal, host_fault, raise_slurm_signal
from harness.runner.record import invalid_record
from harness.spec import InvalidSpec, canonical, config_spec, spec_id
from harness.sweep import claims
from harness.sweep.progress import progress_line
from harness.sweep.store import existing_ids, load_results, record_path, write_record

# Never launched, pruning or not (issue 12: a point estimated at 854x its device was launched): an
# estimate this many times the device's capacity. A wide margin: the committed CPU study's
# out-of-memory runs reach 9.9x, and they stay measured.
LAUNCH_LIMIT = 16.0
HOST_LIMIT = 2.0  # CPU points: the ranks on one host together, against the host's RAM
RETRYABLE = ("ok", "oom", "timeout", "crash", "invalid", "skipped_predicted_oom")


def spec_of(cfg: dict[str, Any]):
    return config_spec(cfg)


def point_id(cfg: dict[str, Any]) -> str:
    return spec_id(spec_of(cfg))


def run_timeout(cfg: dict[str, Any]) -> float:
    """``run.timeout_s``: a finite number of seconds > 0 (inf would overflow the process group's)."""
    try:
        timeout_s = float(cfg["run"]["timeout_s"])
    except (TypeError, ValueError):
        raise ValueError(f"run.timeout_s={cfg['run']['timeout_s']!r} must be a number of seconds") from None
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"run.timeout_s={timeout_s} must be a finite number of seconds > 0")
    return timeout_s


def retry_statuses(cfg: dict[str, Any]) -> frozenset[str]:
    """``sweep.retry``: the statuses whose rows are run again (a list, or ``timeout,crash``)."""
    value = cfg.get("sweep", {}).get("retry") or []
    items = value.split(",") if isinstance(value, str) else list(value)
    statuses = frozenset(str(s).strip() for s in items if str(s).strip())
    unknown = sorted(statuses - set(RETRYABLE))
    if unknown:
        raise SystemExit(
            f"harness sweep: error: sweep.retry={','.join(sorted(statuses))}: unknown status "
            f"{', '.join(unknown)} (one or more of {', '.join(RETRYABLE)})"
        )
    return statuses


def done_statuses(results_dir: str) -> dict[str, str]:
    """config_id -> status of every run of a directory (two columns read)."""
    frame, _ = load_results(results_dir, columns=["config_id", "status"])
    return dict(zip(frame["config_id"], frame["status"], strict=True)) if len(frame) else {}


def host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_rank_limit() -> int:
    """The most CPU ranks one host forks for a point: 8 per core, at least 16 (issue 29: a run of
    dp = 100,000 would have forked that many processes; the studies run up to 8 on 2 cores)."""
    return max(16, 8 * (os.cpu_count() or 1))


def beyond_reach(spec, est, cfg: dict[str, Any]) -> str | None:
    """Why a point must never be launched, whatever the pruning settings: its estimate exceeds the
    device by LAUNCH_LIMIT, or (CPU, where ranks share the host's RAM) its ranks on one host exceed
    the host's memory by HOST_LIMIT. None when it may be launched."""
    if est.utilisation > LAUNCH_LIMIT:
        return f"estimate {est.utilisation:.3g}× capacity > {LAUNCH_LIMIT:g}× (never launched)"
    host = host_memory_bytes()
    per_node = cfg.get("sweep", {}).get("ranks_per_node")
    ranks = min(spec.parallel.world, int(per_node)) if per_node else spec.parallel.world
    if spec.device.name == "cpu" and ranks > host_rank_limit():
        return (
            f"{ranks} ranks on one host, over its limit of {host_rank_limit()} "
            f"(8 per CPU core, at least 16; never launched)"
        )
    if spec.device.name == "cpu" and host:
        need = est.total_bytes * ranks
        if need > HOST_LIMIT * host:
            return (
                f"estimate {need / 2**30:.3g} GiB for the {ranks} ranks on one host, "
                f"{need / host:.3g}× its {host / 2**30:.1f} GiB of RAM > {HOST_LIMIT:g}× (never launched)"
            )
    return None


def triage(
    points: list, configs: list[dict[str, Any]], *, write: bool = True, token: str | None = None
) -> tuple[list[tuple[Any, dict]], str]:
    """Decide each composed point: launch it, or write its row now (invalid, predicted out of memory), or
    skip it (a result exists, or another live sweep holds it). Returns the points to launch and a
    one-line summary. ``write=False`` (a dry run) decides the same and writes nothing. With ``token``
    (a real sweep) each point to launch is claimed first (harness.sweep.claims)."""
    from harness.estimate import estimate

    launch, counts = [], Counter()
    done_by_dir: dict[str, dict[str, str] | set[str]] = {}
    seen: set[tuple[str, str]] = set()  # (results_dir, id) of the points of this grid
    holders: Counter = Counter()
    for point, cfg in zip(points, configs, strict=True):
        results_dir = cfg["results_dir"]
        retry = retry_statuses(cfg)
        try:
            run_timeout(cfg)
        except ValueError as exc:
            raise SystemExit(f"harness sweep: error: {exc}") from None
        if results_dir not in done_by_dir:
            ids = existing_ids(results_dir, set_aside_unreadable=write)  # (unreadable rows: run again)
            if retry:  # which statuses the done points have: two columns of every row read
                ids = {i: st for i, st in done_statuses(results_dir).items() if i in ids}
            done_by_dir[results_dir] = ids
        done = done_by_dir[results_dir]
        try:
            spec = spec_of(cfg)
        except InvalidSpec as exc:  # an unknown key is the study file's mistake: stop, say which
            raise SystemExit(f"harness sweep: error: {exc}") from None
        cid = spec_id(spec)  # the spec is already built: no second from_dict
        if (results_dir, cid) in seen:  # two grids (or two spellings) of the same point: it runs once
            counts["duplicates"] += 1
            continue
        seen.add((results_dir, cid))
        rerun = cid in done and isinstance(done, dict) and done[cid] in retry
        if cid in done and not rerun:
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
        est = estimate(spec, engine="torch")
        factor = float(sweep.get("prune_factor", 2.0))
        reason = beyond_reach(spec, est, cfg)
        if reason is None and sweep.get("prune_predicted_oom") and est.utilisation > factor:
            reason = f"estimate {est.utilisation:.2f}× capacity > prune_factor {factor}"
        if reason is not None:
            row = invalid_record(spec, reason)
            row["status"] = "skipped_predicted_oom"
            if write:
                write_record(_tag(row, cfg), results_dir)
            counts["skipped, predicted out of memory (row written)"] += 1
            continue
        if token is not None:
            got, info = claims.try_claim(results_dir, cid, token)
            if not got:
                holders[claims.describe(info)] += 1
                counts["held by another live sweep (skipped)"] += 1
                continue
        launch.append((point, cfg))
        counts["to rerun (sweep.retry)" if rerun else "to launch"] += 1
    order = (
        "to launch",
        "to rerun (sweep.retry)",
        "already done",
        "held by another live sweep (skipped)",
        "duplicates",
        "invalid (row written)",
        "skipped, predicted out of memory (row written)",
    )
    summary = f"harness sweep: {len(points)} points: " + ", ".join(
        f"{counts[k]} {k}" for k in order if counts[k]
    )
    if holders:
        summary += (
            "\nharness sweep: another sweep is running "
            + ", ".join(f"{n} of these points ({who})" for who, n in holders.most_common())
            + "; run this sweep again once it ends to pick up any it leaves"
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


def run_artifacts(cfg: dict[str, Any]) -> dict[str, Any]:
    """The files each rank writes into results_dir beside the record: ``run.trace`` (its allocation
    trace, JSON) and ``run.memory_snapshot`` (CUDA: PyTorch's memory snapshot, for memory_viz)."""
    run = cfg.get("run") or {}
    trace, snapshot = run.get("trace", False), run.get("memory_snapshot", False)
    for key, value in (("run.trace", trace), ("run.memory_snapshot", snapshot)):
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} must be true or false")
    if not (trace or snapshot):
        return {}
    return {"trace_dir": Path(str(cfg["results_dir"])), "write_trace": trace, "memory_snapshot": snapshot}


def _row_status(results_dir: str, cid: str) -> str | None:
    """The status of the point's row file (None: no row file, or an unreadable one)."""
    import pyarrow.parquet as pq

    path = record_path(results_dir, cid)
    if not path.exists():
        return None
    try:
        return pq.read_table(path, columns=["status"]).column("status")[0].as_py()
    except Exception:
        return None


def run_job(cfg: dict[str, Any]) -> str:
    """One sweep point: claim it, run it and write exactly one row, whatever happens.

    The point runs under its sweep's claim (``sweep.claim``, set by the sweeper; harness.sweep.claims): a
    point another live sweep holds is not run, and the job says so. Under Slurm, USR2 (sent
    ``signal_delay_s`` before the time limit) and TERM interrupt the point: its ranks are reaped and
    its row says ``timeout`` with the reason. (Left to submitit's own handler, the signal would surface
    as an unrelated requeue error.) In a job of several tasks every task runs its ranks and task 0
    alone writes the row. A row that cannot be written (a full disk) stops the sweep with one line.
    """
    results_dir = cfg["results_dir"]
    cid = point_id(cfg)
    token = cfg.get("sweep", {}).get("claim") or claims.new_token()
    retry = retry_statuses(cfg)
    task = slurm_task(results_dir, cid)
    if task is not None and task.index > 0:  # task 0 holds the claim; the others only look at it
        other = claims.holder(results_dir, cid, token)
        if other is not None:
            return f"held by another sweep ({claims.describe(other)})"
        return _run_claimed(cfg, cid, task)
    try:
        got, info = claims.try_claim(results_dir, cid, token)
    except OSError as exc:  # a results_dir gone full or read-only mid-sweep (issue 29): one line, stop
        raise SystemExit(
            f"harness sweep: error: cannot claim {cid} in {results_dir}: {exc.strerror or exc}; the sweep "
            "stops (every row written so far is whole: run it again to resume once there is room)"
        ) from None
    if not got:
        print(
            f"harness sweep: {cid} is being run by another sweep ({claims.describe(info)}): not run here",
            flush=True,
        )
        return "held by another sweep"
    try:
        status = _row_status(results_dir, cid)
        # a second line of defence against double runs (another sweep may have just finished it)
        if record_path(results_dir, cid).exists() and status not in retry:
            return "already done"
        return _run_claimed(cfg, cid, task, token=token)
    finally:
        claims.release(results_dir, cid, token)


def _run_claimed(cfg: dict[str, Any], cid: str, task, *, token: str | None = None) -> str:
    results_dir = cfg["results_dir"]
    start = time.monotonic()
    previous = {}
    if os.environ.get("SLURM_JOB_ID"):
        previous = {s: signal.signal(s, raise_slurm_signal) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        from harness.runner.fake.run import run_configured

        # run.mode real or fake
        row = run_configured(spec_of(cfg), cfg["run"], task=task, artifacts=run_artifacts(cfg))
    except (Exception, SlurmSignal) as exc:  # the supervisor failed or was interrupted: still one row
        if host_fault(exc):  # ... unless the machine failed it (a full TMPDIR): no outcome, no row
            raise SystemExit(
                f"harness sweep: error: {cid} not run: this machine failed it, not the point: "
                f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}; no row written and the "
                "sweep stops (run it again once there is room: it resumes)"
            ) from None
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
    if token is not None and not claims.still_mine(results_dir, cid, token):
        # Another sweep took the point over meanwhile (this one was stopped past its claim's expiry, on
        # another host): its row is the truth, this result would overwrite it (issue 29).
        print(
            f"harness sweep: {cid}: the claim was taken over by another sweep while this one ran it; "
            f"this result ({row['status']}) is discarded",
            flush=True,
        )
        return "discarded: claim lost"
    try:
        write_record(_tag(row, cfg), results_dir)
    except OSError as exc:  # a full disk, a directory gone read-only: stop here, say it in one line
        raise SystemExit(
            f"harness sweep: error: cannot write the row of {cid} to {results_dir}: "
            f"{exc.strerror or exc}; the sweep stops (every row written so far is whole: run it again "
            "to resume once there is room)"
        ) from None
    print(progress_line(results_dir, row, time.monotonic() - start), flush=True)
    return row["status"]


def check_writable(results_dir: str) -> None:
    """A results_dir a sweep can write to, or one line saying why not (before anything is launched)."""
    root = Path(results_dir)
    if root.exists() and not root.is_dir():
        raise SystemExit(f"harness sweep: error: results_dir={results_dir} is a file, not a directory")
    probe = root / f".harness-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as exc:
        raise SystemExit(
            f"harness sweep: error: results_dir={results_dir} is not writable: {exc.strerror or exc}"
        ) from None
