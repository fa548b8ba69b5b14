"""Run one point: validate, fork one worker per rank, bound everything by a timeout, reap every process,
and return exactly one record whatever happened (ok, oom, timeout, crash, invalid).

Workers are forked from this process, which has imported torch and the harness once, instead of one
``torchrun`` per point (about half the wall time of an 8-rank point on 2 cores, ../shared/research).
Nothing here runs a torch operation before forking: forked OpenMP or gloo threads would not survive.
"""

from __future__ import annotations

import ctypes
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

from harness.record import finish_record, invalid_record
from harness.specs import InvalidSpec, RunSpec, canonical

POLL_S = 0.05
PEER_POLL_S = 0.5  # how often a task of a multi-task point looks at the shared directory
PEER_MARGIN_S = 30.0  # how much later than task 0's deadline another task may report (start skew)
GRACE_S = 10.0  # after one rank fails, how long the others get to fail on their own and report
POINT_DIR_PREFIX = "harness-point-"  # + the supervisor's pid: a leftover's owner is known (issue 12)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a healthy rank reports when a peer never arrives at a collective (gloo, the TCPStore) or left it:
# a symptom, never the cause (issue 12: a hung rank was recorded as rank 0's crash).
SYMPTOMS = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe")
HOST_OOM_ERRORS = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


class Terminated(BaseException):
    """SIGTERM reached the supervisor or one of its ranks (``kill``, a job scheduler): the point's ranks
    are reaped, no record is written (the point did not run to an outcome; a resumed sweep runs it
    again), and the exception goes on up. A BaseException so that handlers of ordinary errors let it
    through; the command line turns it into one line and exit status 143 (128 + SIGTERM)."""


def _raise_terminated(signum, frame):
    raise Terminated("SIGTERM")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: a reader (another rank, another node's task) sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def die_with_parent(parent_pid: int) -> None:
    """In a forked rank: ask the kernel to SIGKILL this process when its supervisor dies, however it
    dies (``kill -9`` of a sweep left its ranks running for hours, re-parented to init: issue 12).
    The supervisor may have died between the fork and this call: then the parent is already another
    process, and the rank ends at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own reaping still holds
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_leftover_point_dirs(root: str | None = None) -> list[str]:
    """Remove the temporary point directories (``harness-point-<pid>-*``) whose supervisor is dead: a
    supervisor killed with SIGKILL cannot remove its own. Those of live supervisors (another sweep on
    this host) are left alone. Returns the directories removed."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{POINT_DIR_PREFIX}*"):
        owner = path.name[len(POINT_DIR_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def host_oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer ended (``oom_kill`` of /proc/vmstat, or of this
    cgroup's memory.events under cgroup v2); None where neither says."""
    total = None
    for path in ("/proc/vmstat", "/sys/fs/cgroup/memory.events"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    total = (total or 0) + int(value)
        except (OSError, ValueError):
            continue
    return total


_STORE = None  # rank 0's TCPStore server bound to the loopback interface (kept alive for the rank)


def _bind_store_to_loopback(port: int, world: int, timeout_s: float) -> None:
    """Rank 0 of a point whose ranks are all on this host: start the TCPStore server on 127.0.0.1
    only (torch's own listens on every interface, issue 12). ``init_process_group`` then finds it:
    its store is multi-tenant and reuses this process's server on the same port."""
    global _STORE
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:  # the port was taken meanwhile: torch's own bind will say so
        sock.close()
        return
    _STORE = dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def _rank_main(rank_fn, parent_pid: int, loopback: bool, rank: int, spec, **kwargs) -> None:
    """A forked rank: tied to its supervisor's life, its store on loopback when every rank is local."""
    die_with_parent(parent_pid)
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay local too
        if rank == 0:
            _bind_store_to_loopback(kwargs["port"], spec.parallel.world, kwargs["timeout_s"])
    rank_fn(rank, spec, **kwargs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if spec.device.name != "cpu":
        import torch

        if not torch.cuda.is_available():
            out.append(f"device {spec.device.name} needs CUDA, and this machine has none (use device=cpu)")
    return out


def _read(out_dir: Path, rank: int) -> dict[str, Any]:
    path = out_dir / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rank": rank}


def _last_log_line(out_dir: Path, rank: int) -> str:
    try:
        lines = [
            ln for ln in (out_dir / f"rank{rank}.log").read_text(errors="replace").splitlines() if ln.strip()
        ]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _symptom(entry: tuple[int, int, dict]) -> bool:
    """A rank that failed only because a peer did not arrive or left (its own collective timed out,
    its connection closed): gloo reports a peer's hang or death as this rank's error."""
    err = (entry[2].get("error") or "").lower()
    return entry[1] is not None and entry[1] > 0 and any(s in err for s in SYMPTOMS)


def _culprit(failed: list[tuple[int, int, dict]]) -> tuple[int, int, dict]:
    """The rank whose failure is the cause: one that was killed, else one whose error is not merely a
    symptom of a peer, else the first."""
    for entry in failed:
        if entry[1] is not None and entry[1] < 0:
            return entry
    return next((entry for entry in failed if not _symptom(entry)), failed[0])


def _host_oom(entry: tuple[int, int, dict], oom_kills: int | None) -> bool:
    """The host ran out of memory for this rank: a failed host allocation, or a SIGKILL while the
    kernel's OOM killer ended a process (issue 12: such rows said ``crash``)."""
    err = entry[2].get("error") or ""
    if any(s in err for s in HOST_OOM_ERRORS):
        return True
    return entry[1] == -signal.SIGKILL and bool(oom_kills)


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
) -> dict[str, Any] | None:
    """Run ``spec`` once and return its record. ``rank_fn(rank, spec, port=, out_dir=, timeout_s=,
    master_addr=, local_rank=, local_world=)`` is the per-rank entry point (the real worker by default;
    tests inject failures through it).

    With ``task`` (one of several tasks of a point wider than a node) this process runs its block of
    ranks; task 0 waits for the others' outcomes and returns the record, the others return None.
    ``artifacts``: files each rank writes beside the record (keyword arguments of the worker:
    ``trace_dir``, ``write_trace`` for ``run.trace``, ``memory_snapshot`` for ``run.memory_snapshot``).
    """
    task = task or Task()
    if task.count > 1 and task.shared_dir is None:
        raise ValueError("a point spread over several tasks needs a shared_dir that every task reaches")
    try:
        spec = canonical(spec)
    except InvalidSpec as exc:
        return invalid_record(spec, str(exc)) if task.index == 0 else None
    problems = runner_problems(spec)
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
        record = _record(spec, out_dir, outcomes, timeout_s, count=task.count)
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
    # The process group's own timeout fires a little before ours, so that a stuck collective is
    # reported by the rank itself when it can be.
    pg_timeout = max(5.0, timeout_s - 5.0)
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
    # harness.sweep.run_job's) is left in place: it raises too.
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


def _record(
    spec: RunSpec, out_dir: Path, outcomes: list[dict], timeout_s: float, *, count: int
) -> dict[str, Any]:
    """The point's one record from every task's outcome and every rank's numbers."""
    world = spec.parallel.world
    ranks = [_read(out_dir, r) for r in range(world)]
    codes: dict[int, int | None] = {}
    killed_here: set[int] = set()
    for o in outcomes:
        codes.update(zip(o["ranks"], o["codes"], strict=True))
        killed_here.update(o["killed"])
    timed_out = any(o["timed_out"] for o in outcomes)
    device_name = _device_name(spec)
    common = {
        "wall_s": outcomes[0]["wall_s"],
        "device_name": device_name,
        "launch_tasks": count,
        "launch_hosts": [o["host"] for o in outcomes],
    }
    if len(codes) < world:  # a whole task is missing: that, not its peers' broken collectives, is the cause
        silent = [r for r in range(world) if r not in codes]
        return finish_record(
            spec,
            ranks,
            status="crash",
            error=f"ranks {silent[0]}-{silent[-1]} never reported: their task (node) failed or never "
            f"started; {len(outcomes)} of {count} tasks reported",
            error_rank=silent[0],
            exit_code=None,
            **common,
        )
    # Ranks a supervisor killed (stragglers after a failure, or everyone at the deadline) are not the
    # cause of anything.
    failed = [(r, c, ranks[r]) for r, c in sorted(codes.items()) if c != 0 and r not in killed_here]
    outside = [r for r, _, info in failed if (info.get("error") or "").startswith(f"{Terminated.__name__}:")]
    if outside:
        # A rank forked from this supervisor inherits its SIGTERM handler and ends with Terminated: the
        # signal came from outside (``kill`` of the sweep's process group, as a shell's job control or a
        # tool stopping a job sends it), not from the point. Seen: an interrupted local sweep left a
        # `crash` row "Terminated: SIGTERM" that its resume never ran again. No row, as when SIGTERM
        # reaches the supervisor itself.
        raise Terminated(f"SIGTERM reached rank {outside[0]}: the point has no outcome")
    stuck = sorted(killed_here)
    if failed and stuck and all(_symptom(entry) for entry in failed):
        # Every rank that ended did so on a peer's absence, and the ranks still running when the
        # supervisor gave up are those peers: the point hung in them (issue 12).
        names = ", ".join(str(r) for r in stuck)
        first = failed[0]
        return finish_record(
            spec,
            ranks,
            status="timeout",
            error=f"rank{'s' * (len(stuck) > 1)} {names} never arrived at a collective (still running, "
            f"killed); rank {first[0]}'s own error is the symptom: {first[2].get('error') or ''}"[:500],
            error_rank=stuck[0],
            exit_code=None,
            **common,
        )
    if failed:
        entry = _culprit(failed)
        rank, code, info = entry
        oom_kills = sum(o.get("host_oom_kills") or 0 for o in outcomes)
        host_oom = _host_oom(entry, oom_kills)
        status = "oom" if host_oom or any(r[2].get("oom") for r in failed) else "crash"
        if code is not None and code < 0:
            error = f"rank {rank} killed by signal {signal.Signals(-code).name}"
            if host_oom:
                error += " (the host's OOM killer ran during the point)"
        else:
            error = info.get("error") or _last_log_line(out_dir, rank) or f"rank {rank} exited with {code}"
        row = finish_record(
            spec, ranks, status=status, error=error, error_rank=rank, exit_code=code, **common
        )
        if host_oom:
            row["oom_source"] = "host"
        return row
    if timed_out:
        return finish_record(
            spec,
            ranks,
            status="timeout",
            error=f"no result within {timeout_s:g} s; {len(killed_here)} of {world} ranks killed",
            error_rank=None,
            exit_code=None,
            **common,
        )
    return finish_record(spec, ranks, status="ok", error=None, error_rank=None, exit_code=0, **common)


def _device_name(spec: RunSpec) -> str:
    if spec.device.name == "cpu":
        return platform_cpu_name()
    import torch

    return torch.cuda.get_device_name(0)


def platform_cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
