"""A point's outcome from every rank's report and exit code: which rank failed first and why (a peer's
timeout is a symptom, never the cause; a host OOM kill is an ``oom``), and the one record."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from harness.runner.procs import HOST_FAULT_EXIT, HostFault, SlurmSignal, Terminated
from harness.runner.record import finish_record
from harness.spec import RunSpec

# What a healthy rank reports when a peer never arrives at a collective (gloo, the TCPStore) or left it:
# a symptom, never the cause (issue 12: a hung rank was recorded as rank 0's crash).
SYMPTOMS = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe")
HOST_OOM_ERRORS = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def _read(out_dir: Path, rank: int) -> dict[str, Any]:
    path = out_dir / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rank": rank}


def _log_lines(out_dir: Path, rank: int) -> list[str]:
    """The rank's log (its stdout and stderr), line by line; none where it is missing."""
    try:
        return (out_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []


def _last_log_line(out_dir: Path, rank: int) -> str:
    lines = [ln for ln in _log_lines(out_dir, rank) if ln.strip()]
    return lines[-1][:300] if lines else ""


# NCCL's watchdog, when a collective outlives the process group's timeout, logs this line and (with
# TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, the default) aborts the process: SIGABRT, no result file
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, WorkNCCL::checkTimeout). The worker asks for 2
# (clean up without tearing the process down), so the rank reports; the line is read where it did not.
NCCL_WATCHDOG = "Watchdog caught collective operation timeout"


def _watchdog_line(out_dir: Path, rank: int) -> str | None:
    """The NCCL watchdog's timeout line in the rank's log, if it is there."""
    return next((ln.strip()[:300] for ln in _log_lines(out_dir, rank) if NCCL_WATCHDOG in ln), None)


def _fatal_lines(out_dir: Path, rank: int) -> str:
    """Why a rank died by a signal, from its log: a C++ ``terminate``'s exception (``what():``) and
    the innermost Python frame of the thread that took the signal (the worker points ``faulthandler``
    at the log). Empty when the log says nothing of it (a SIGKILL from outside)."""
    lines = _log_lines(out_dir, rank)
    said = [ln.strip() for ln in lines if "terminate called" in ln or ln.strip().startswith("what():")]
    current = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if current is not None and current + 1 < len(lines) and lines[current + 1].strip():
        said.append(f"in {lines[current + 1].strip()}")
    return "; ".join(said)[:400]


def _symptom(entry: tuple[int, int, dict]) -> bool:
    """A rank that failed only because a peer did not arrive or left (its own collective timed out,
    its connection closed): gloo reports a peer's hang or death as this rank's error, and NCCL's
    watchdog aborts a waiting rank (SIGABRT) with its timeout line in the log."""
    err = (entry[2].get("error") or "").lower()
    code = entry[1]
    ended = code is not None and (code > 0 or code == -signal.SIGABRT)
    return ended and any(s in err for s in SYMPTOMS)


def _culprit(failed: list[tuple[int, int, dict]]) -> tuple[int, int, dict]:
    """The rank whose failure is the cause: one killed from outside (SIGKILL: the OOM killer, a
    kill), else one that reported an error of its own that is not merely a symptom of a peer, else
    one that aborted itself (SIGABRT: a C++ terminate, which gloo's and NCCL's threads reach when a
    peer is lost — seen: rank 3 raised, and rank 1, waiting for it in gloo, aborted and was blamed),
    else the first."""

    def killed(entry, *, abort: bool) -> bool:
        code = entry[1]
        return code is not None and code < 0 and (code == -signal.SIGABRT) == abort

    for entry in failed:
        if killed(entry, abort=False):
            return entry
    for entry in failed:
        if entry[1] is not None and entry[1] > 0 and not _symptom(entry):
            return entry
    return next((entry for entry in failed if not _symptom(entry)), failed[0])


def _host_oom(entry: tuple[int, int, dict], oom_kills: int | None) -> bool:
    """The host ran out of memory for this rank: a failed host allocation, or a SIGKILL while the
    kernel's OOM killer ended a process (issue 12: such rows said ``crash``)."""
    err = entry[2].get("error") or ""
    if any(s in err for s in HOST_OOM_ERRORS):
        return True
    return entry[1] == -signal.SIGKILL and bool(oom_kills)


def point_record(
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
    for r, code in codes.items():
        if code == -signal.SIGABRT and not ranks[r].get("error"):
            line = _watchdog_line(out_dir, r)
            if line:
                ranks[r]["error"] = line
    device_name = _device_name(spec, ranks)
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
    faults = [r for r, c in sorted(codes.items()) if c == HOST_FAULT_EXIT or ranks[r].get("host_fault")]
    if faults:  # the machine failed the point (procs.HOST_FAULT_ERRNOS): no record, as for SIGTERM
        why = ranks[faults[0]].get("host_fault") or f"it could not write its report in {out_dir}"
        raise HostFault(
            f"rank {faults[0]}: {why} (a full or read-only scratch directory, or too many open files)"
        )
    # Ranks a supervisor killed (stragglers after a failure, or everyone at the deadline) are not the
    # cause of anything.
    failed = [(r, c, ranks[r]) for r, c in sorted(codes.items()) if c != 0 and r not in killed_here]
    # A rank forked from this supervisor inherits its signal handlers and can end on a signal meant for
    # the whole point before the supervisor sees it: not the point's outcome.
    signalled = {
        kind: [r for r, _, info in failed if (info.get("error") or "").startswith(f"{kind.__name__}:")]
        for kind in (Terminated, SlurmSignal)
    }
    if signalled[Terminated]:
        # SIGTERM from outside (``kill`` of the sweep's process group, as a shell's job control or a tool
        # stopping a job sends it). Seen: an interrupted local sweep left a `crash` row "Terminated:
        # SIGTERM" that its resume never ran again. No row, as when SIGTERM reaches the supervisor itself.
        raise Terminated(f"SIGTERM reached rank {signalled[Terminated][0]}: the point has no outcome")
    if signalled[SlurmSignal]:
        # Slurm's time-limit warning (or its TERM) reached every process of the job step, and this rank
        # ended on it first: the point was cut short, as when the supervisor is signalled (a `timeout`
        # row, harness.sweep.launch.run_job), not a crash of the rank's own.
        r = signalled[SlurmSignal][0]
        raise SlurmSignal(f"{ranks[r]['error'].removeprefix('SlurmSignal: ')} (it reached rank {r} first)")
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
            fatal = _fatal_lines(out_dir, rank)
            if fatal:
                error += f" ({fatal})"
            if info.get("losses") and not info.get("error"):
                error += " after it had reported its results (in the process group's teardown)"
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


def _device_name(spec: RunSpec, ranks: list[dict[str, Any]]) -> str | None:
    """The CPU's model name, or the GPU's as a rank reported it (this process never initialises CUDA:
    its ranks are forked from it, harness/runner/devices.py); the probe's when no rank got that far."""
    if spec.device.name == "cpu":
        return platform_cpu_name()
    named = next((r["device_name"] for r in ranks if r.get("device_name")), None)
    if named is None:
        from harness.runner import devices

        named = devices.probe().get("device_name")
    return named


def platform_cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
