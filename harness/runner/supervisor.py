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
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness.record import finish_record, invalid_record
from harness.specs import InvalidSpec, RunSpec, canonical

POLL_S = 0.05
GRACE_S = 10.0  # after one rank fails, how long the others get to fail on their own and report


class Terminated(BaseException):
    """SIGTERM reached the supervisor (``kill``, a job scheduler): the point's ranks are reaped, no
    record is written (the point did not run to an outcome; a resumed sweep runs it again), and the
    exception goes on up. A BaseException so that handlers of ordinary errors let it through."""


def _raise_terminated(signum, frame):
    raise Terminated("SIGTERM")


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


def _culprit(failed: list[tuple[int, int, dict]]) -> tuple[int, int, dict]:
    """The rank whose failure is the cause: one that was killed, else one whose error is not merely a
    peer's connection closing (gloo reports a dead peer as its own error), else the first."""
    for entry in failed:
        if entry[1] < 0:
            return entry
    for entry in failed:
        err = entry[2].get("error", "")
        if not any(
            s in err for s in ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out")
        ):
            return entry
    return failed[0]


def run_point(
    spec: RunSpec,
    *,
    timeout_s: float = 300.0,
    rank_fn=None,
    keep_dir: Path | None = None,
) -> dict[str, Any]:
    """Run ``spec`` once and return its record. ``rank_fn(rank, spec, port=, out_dir=, timeout_s=)`` is the
    per-rank entry point (the real worker by default; tests inject failures through it)."""
    try:
        spec = canonical(spec)
    except InvalidSpec as exc:
        return invalid_record(spec, str(exc))
    problems = runner_problems(spec)
    if problems:
        return invalid_record(spec, "; ".join(problems))
    if rank_fn is None:
        from harness.runner.worker import run_rank as rank_fn

    world = spec.parallel.world
    with tempfile.TemporaryDirectory(prefix="harness-point-") as tmp:
        out_dir = keep_dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx = multiprocessing.get_context("fork")
        port = free_port()
        # The process group's own timeout fires a little before ours, so that a stuck collective is
        # reported by the rank itself when it can be.
        pg_timeout = max(5.0, timeout_s - 5.0)
        procs = [
            ctx.Process(
                target=rank_fn,
                args=(r, spec),
                kwargs={"port": port, "out_dir": out_dir, "timeout_s": pg_timeout},
                daemon=True,
            )
            for r in range(world)
        ]
        start = time.monotonic()
        deadline, first_failure, timed_out = start + timeout_s, None, False
        killed_here: set[int] = set()
        # With the default SIGTERM action this process would die at once and leave its ranks running
        # (seen: a killed sweep's 8 ranks outlived it). A handler someone installed (under Slurm,
        # harness.sweep.run_job's) is left in place: it raises too.
        previous = None
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
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
                if now >= deadline:
                    timed_out = True
                    break
                if first_failure is not None and now - first_failure >= GRACE_S:
                    break
                time.sleep(POLL_S)
        finally:
            # Reap everything, whatever state it is in — also when this loop is interrupted (a signal
            # from Slurm raised in this process, Ctrl-C): no rank outlives its point.
            for r, proc in enumerate(procs):
                if proc.pid is None:
                    continue
                if proc.exitcode is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_here.add(r)
                proc.join(timeout=10)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        wall = time.monotonic() - start
        ranks = [_read(out_dir, r) for r in range(world)]
        codes = [proc.exitcode for proc in procs]
        # Ranks this supervisor killed (stragglers after a failure, or everyone at the deadline) are
        # not the cause of anything.
        failed = [(r, c, ranks[r]) for r, c in enumerate(codes) if c != 0 and r not in killed_here]
        device_name = _device_name(spec)
        common = {"wall_s": wall, "device_name": device_name}
        if failed:
            rank, code, info = _culprit(failed)
            status = "oom" if any(r[2].get("oom") for r in failed) else "crash"
            if code is not None and code < 0:
                error = f"rank {rank} killed by signal {signal.Signals(-code).name}"
            else:
                error = (
                    info.get("error") or _last_log_line(out_dir, rank) or f"rank {rank} exited with {code}"
                )
            return finish_record(
                spec, ranks, status=status, error=error, error_rank=rank, exit_code=code, **common
            )
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
