"""Run one point: validate, fork one worker per rank, bound everything by a timeout, reap every process,
and return exactly one record whatever happened (ok, oom, timeout, crash, invalid).

Workers are forked from this process, which has imported torch and the harness once, instead of one
``torchrun`` per point (about half the wall time of an 8-rank point on 2 cores, ../shared/research).
Nothing here runs a torch operation before forking: forked OpenMP or gloo threads would not survive.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.runner import devices
from harness.runner.outcome import point_record
from harness.runner.procs import (
    POINT_DIR_PREFIX,
    _raise_terminated,
    _rank_main,
    clean_leftover_point_dirs,
    free_port,
    host_oom_kills,
    write_json,
)
from harness.runner.record import invalid_record
from harness.spec import InvalidSpec, RunSpec, canonical
from harness.spec.validate import runner_limits

POLL_S = 0.05
PEER_POLL_S = 0.5  # how often a task of a multi-task point looks at the shared directory
PEER_MARGIN_S = 30.0  # how much later than task 0's deadline another task may report (start skew)
GRACE_S = 10.0  # after one rank fails, how long the others get to fail on their own and report


def runner_problems(spec: RunSpec) -> list[str]:
    """What the runner cannot do on this machine, beyond the spec's own validation."""
    out = []
    if spec.train.steps < 2:
        out.append(
            f"train.steps={spec.train.steps}: the runner needs >= 2 (one warm-up, then measured steps)"
        )
    p = spec.parallel
    if p.pp > 1 and p.zero_stage == 1 and p.dp * p.cp > 1:
        # Pipeline stages replicate with composable ``replicate`` (DTensor parameters), which
        # ZeroRedundancyOptimizer cannot shard ("c10d.broadcast_ does not have a sharding strategy").
        out.append(
            "the runner cannot combine pp > 1 with zero_stage 1 over dp·cp > 1 (ZeroRedundancyOptimizer "
            "does not accept the replicated DTensor parameters of pipeline stages); use zero_stage 0, 2 or 3"
        )
    return out + runner_limits(spec)


def device_problems(spec: RunSpec) -> list[str]:
    """What this machine's devices cannot run (GPU presets only), asked of a throwaway child
    (:func:`devices.probe`): this process must not initialise CUDA before it forks the ranks."""
    if spec.device.name == "cpu":
        return []
    found = devices.probe()
    if not found.get("device_count"):
        why = f" ({found['error']})" if found.get("error") else ""
        return [f"device {spec.device.name} needs CUDA, and this machine has none{why} (use device=cpu)"]
    m, t = spec.model, spec.train
    if (
        t.precision == "fp32"
        and t.attention == "flash"
        and m.num_kv_heads < m.num_heads
        and found.get("fused_gqa_fp32") is False
    ):
        return [
            f"train.attention=flash with grouped-query attention ({m.num_heads} heads, {m.num_kv_heads} KV "
            f"heads) in fp32: no fused SDPA kernel of torch {found.get('torch_version')} on this GPU runs it "
            "(flash and cuDNN take 16-bit inputs, memory-efficient no GQA); use train.precision=bf16 or "
            "train.attention=math"
        ]
    return []


@dataclass(frozen=True)
class Task:
    """Where this supervisor sits among the tasks a point's ranks are spread over.

    The default is the one local task that forks every rank. A point wider than a node runs as
    ``count`` tasks (one per node under Slurm, started by ``srun``), each forking its own contiguous
    block of ranks; the tasks meet at ``master_addr:port`` (rank 0's TCPStore) and share
    ``shared_dir``, where every rank writes its numbers and every task its outcome, so that task 0
    can write the point's one record. torch's elastic launcher would start the ranks too, but the
    forked worker is what the local path measures (half the start-up of a ``torchrun`` per point,
    ../shared/research), and one code path for one node and many keeps the numbers comparable.
    """

    index: int = 0
    count: int = 1
    master_addr: str = "127.0.0.1"
    port: int | None = None  # None: a free port of this machine (one task only)
    shared_dir: Path | None = None  # required when count > 1: a directory every task can reach
    tasks_per_node: int = 1  # several tasks on one node (one per GPU, say) share its devices
    node_task: int = 0  # this task's index on its node
    host: str = field(default_factory=lambda: os.environ.get("SLURMD_NODENAME") or socket.gethostname())

    def block(self, world: int) -> int:
        """Ranks per task (the last tasks may have fewer, or none)."""
        return -(-world // self.count)

    def ranks(self, world: int) -> range:
        """This task's contiguous block of global ranks (tensor-parallel groups, the innermost mesh
        dimension, stay inside a block when its size is a multiple of tp)."""
        per = self.block(world)
        return range(min(world, self.index * per), min(world, (self.index + 1) * per))

    def placement(self, world: int) -> tuple[int, int]:
        """(node-local index of this task's first rank, ranks on this node): which device each rank
        takes, and how many share the node."""
        if self.count == 1:
            return 0, world
        per = self.block(world)
        return self.node_task * per, min(world, per * self.tasks_per_node)


def process_group_timeout(timeout_s: float) -> float:
    """The process group's timeout for a point given ``timeout_s``: well before ours (a fifth of it, at
    least 30 s when the point has that long), so that a stuck collective is reported by a rank itself —
    NCCL's watchdog names the collective and its peers in the rank's log — before the supervisor has to
    kill every rank and can only say the point timed out."""
    return max(5.0, min(0.8 * timeout_s, timeout_s - 30.0))


def _task_file(out_dir: Path, index: int) -> Path:
    return out_dir / f"task{index}.json"


def _failure_marker(out_dir: Path, index: int) -> Path:
    return out_dir / f"task{index}.failed"


def run_point(
    spec: RunSpec,
    *,
    timeout_s: float = 300.0,
    rank_fn=None,
    keep_dir: Path | None = None,
    task: Task | None = None,
    artifacts: dict[str, Any] | None = None,
    share_gpus: bool = False,
) -> dict[str, Any] | None:
    """Run ``spec`` once and return its record. ``rank_fn(rank, spec, port=, out_dir=, timeout_s=,
    master_addr=, local_rank=, local_world=)`` is the per-rank entry point (the real worker by default;
    tests inject failures through it).

    With ``task`` (one of several tasks of a point wider than a node) this process runs its block of
    ranks; task 0 waits for the others' outcomes and returns the record, the others return None.
    ``artifacts``: files each rank writes beside the record (keyword arguments of the worker:
    ``trace_dir``, ``write_trace`` for ``run.trace``, ``memory_snapshot`` for ``run.memory_snapshot``).
    ``share_gpus`` (``run.share_gpus``): let a node's ranks share its GPUs when they outnumber them
    (:func:`devices.placement`).

    Nothing here initialises CUDA: the ranks are forked from this process (harness/runner/devices.py).
    """
    task = task or Task()
    if task.count > 1 and task.shared_dir is None:
        raise ValueError("a point spread over several tasks needs a shared_dir that every task reaches")
    try:
        spec = canonical(spec)
    except InvalidSpec as exc:
        return invalid_record(spec, str(exc)) if task.index == 0 else None
    problems = runner_problems(spec) or device_problems(spec)
    if not problems and spec.device.name != "cpu":
        where = task.placement(spec.parallel.world)
        placed = devices.placement(
            node_world=where[1],
            task_ranks=len(task.ranks(spec.parallel.world)),
            first_local=where[0],
            visible=devices.visible_devices(),
            share=share_gpus,
            pp=spec.parallel.pp,
        )
        problems = [placed] if isinstance(placed, str) else []
    if problems:
        return invalid_record(spec, "; ".join(problems)) if task.index == 0 else None
    if rank_fn is None:
        from harness.runner.worker import run_rank as rank_fn

    world = spec.parallel.world
    mine = task.ranks(world)
    clean_leftover_point_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{POINT_DIR_PREFIX}{os.getpid()}-") as tmp:
        out_dir = task.shared_dir or keep_dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        outcome = _run_ranks(spec, mine, task, rank_fn, out_dir, timeout_s, artifacts or {})
        if task.count > 1:
            write_json(_task_file(out_dir, task.index), outcome)
        if task.index > 0:
            return None
        deadline = outcome["started"] + timeout_s + GRACE_S + PEER_MARGIN_S
        outcomes = [outcome, *_peer_outcomes(task, out_dir, deadline=deadline)]
        record = point_record(spec, out_dir, outcomes, timeout_s, count=task.count)
        if task.count > 1 and len(outcomes) == task.count and keep_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)  # kept when a task never reported: its logs
        return record


def _run_ranks(
    spec: RunSpec, mine: range, task: Task, rank_fn, out_dir: Path, timeout_s: float, artifacts: dict
) -> dict:
    """Fork this task's ranks, wait for them within the timeout, reap them all; their exit codes."""
    ctx = multiprocessing.get_context("fork")
    port = task.port or free_port()
    first_local, node_world = task.placement(spec.parallel.world)
    if spec.device.name != "cpu":  # (run_point checked that the ranks can be placed)
        first_local, node_world = devices.placement(
            node_world=node_world,
            task_ranks=len(mine),
            first_local=first_local,
            visible=devices.visible_devices(),
            share=True,
            pp=1,
        )
    pg_timeout = process_group_timeout(timeout_s)
    loopback = task.count == 1 and task.master_addr in ("127.0.0.1", "localhost")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank_fn, os.getpid(), loopback, r, spec),
            kwargs={
                "port": port,
                "out_dir": out_dir,
                "timeout_s": pg_timeout,
                "master_addr": task.master_addr,
                "local_rank": first_local + r - mine.start,
                "local_world": node_world,
                **artifacts,  # only when asked: injected test rank functions do not take them
            },
            daemon=True,
        )
        for r in mine
    ]
    start, started = time.monotonic(), time.time()
    deadline, first_failure, timed_out = start + timeout_s, None, False
    next_peer_check = start
    killed_here: set[int] = set()
    # With the default SIGTERM action this process would die at once and leave its ranks running
    # (seen: a killed sweep's 8 ranks outlived it). A handler someone installed (under Slurm,
    # harness.sweep.launch.run_job's) is left in place: it raises too.
    previous = None
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    oom_kills = host_oom_kills()
    try:
        for proc in procs:
            proc.start()
        while True:
            codes = [proc.exitcode for proc in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
                if task.count > 1:  # the other tasks' ranks are stuck in a collective with ours
                    _failure_marker(out_dir, task.index).touch()
            if first_failure is None and task.count > 1 and now >= next_peer_check:
                next_peer_check = now + PEER_POLL_S
                if any(_failure_marker(out_dir, k).exists() for k in range(task.count) if k != task.index):
                    first_failure = now
            if now >= deadline:
                timed_out = True
                break
            if first_failure is not None and now - first_failure >= GRACE_S:
                break
            time.sleep(POLL_S)
    finally:
        # Reap everything, whatever state it is in — also when this loop is interrupted (a signal
        # from Slurm raised in this process, Ctrl-C): no rank outlives its point.
        for r, proc in zip(mine, procs, strict=True):
            if proc.pid is None:
                continue
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
                killed_here.add(r)
            proc.join(timeout=10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return {
        "task": task.index,
        "host": task.host,
        "ranks": list(mine),
        "codes": [proc.exitcode for proc in procs],
        "killed": sorted(killed_here),
        "timed_out": timed_out,
        "host_oom_kills": None if oom_kills is None else (host_oom_kills() or 0) - oom_kills,
        "started": started,
        "wall_s": time.monotonic() - start,
    }


def _peer_outcomes(task: Task, out_dir: Path, *, deadline: float) -> list[dict]:
    """Task 0: the other tasks' outcomes, waiting for them until ``deadline`` (Unix time)."""
    missing = list(range(1, task.count))
    found: dict[int, dict] = {}
    while missing:
        for k in list(missing):
            try:
                found[k] = json.loads(_task_file(out_dir, k).read_text())
                missing.remove(k)
            except (OSError, ValueError):
                pass
        if not missing or time.time() >= deadline:
            break
        time.sleep(PEER_POLL_S)
    return [found[k] for k in sorted(found)]
