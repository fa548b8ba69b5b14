"""Tracing ranks side by side: each rank in a forked process of a parent that has imported what a trace
needs, as many at a time as the CPUs and host memory allow, in the order and with the stop at the
first failure that one-at-a-time tracing would have."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from harness.runner.fake.ranks import _zero1_worst_rank
from harness.runner.fake.trace import trace_rank
from harness.runner.procs import Terminated
from harness.spec import RunSpec, config_id, spec_id

log = logging.getLogger(__name__)


def _trace_ranks(
    spec: RunSpec,
    base: list[int],
    *,
    deadline: float,
    kernels: str,
    jobs: int,
    cache=None,
    trace_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The results of tracing ``base`` and every ZeRO-1 rank a result names, up to ``jobs`` processes at
    a time: the same list, in the same order, as tracing them one at a time, each named rank queued
    behind the rest, and stopping at the first failure (``_sequence``). After a failure only the ranks
    before it in that order are started or kept running. A rank ``cache`` (a ``TraceCache``) holds is
    taken from it; each completed trace is stored there. ``trace_dir`` (``run.trace``): each rank's
    allocation trace is written there as ``<config_id>.rank<r>.trace.json`` (the cache, which keeps no
    traces, is not read then)."""
    results: dict[int, dict[str, Any]] = {}
    extras: dict[int, int | None] = {}  # traced rank → the ZeRO-1 rank its result names
    running: dict[int, tuple[Any, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="harness-fake-") as tmp, _reaped(running):
        while True:
            order, cut = _sequence(base, extras, results)
            for rank in [r for r in running if order.index(r) >= cut]:
                _kill(running.pop(rank)[0])
            todo = [r for r in order[:cut] if r not in results and r not in running]
            reused = False
            while todo and len(running) < max(1, jobs):
                rank = todo.pop(0)
                hit = cache.load(spec, rank, kernels) if cache is not None and trace_dir is None else None
                if hit is not None:
                    log.info("fake: rank %d of %s taken from the trace cache", rank, config_id(spec))
                    # (an entry may come from the same layout with another dp: fake_cache)
                    results[rank], reused = {**hit, "rank": rank, "cached": True}, True
                    extras[rank] = _zero1_worst_rank(spec, results[rank])
                    continue
                out = Path(tmp) / f"rank{rank}.json"
                running[rank] = _start_child(
                    spec, rank, out, kernels, trace_dir, keep_events=cache is not None
                )
            if reused:
                continue  # (a reused result may name a ZeRO-1 rank: look at the order again)
            if not running:
                break
            for rank, result in _wait_any(running, deadline).items():
                events = result.pop("events", None)
                results[rank] = result
                if "peak_allocated_bytes" in result:
                    extras[rank] = _zero1_worst_rank(spec, result)
                    if cache is not None:
                        cache.store(spec, rank, kernels, result, events)
    order, cut = _sequence(base, extras, results)
    return [results[r] for r in order[: cut + 1] if r in results]


def _sequence(
    base: list[int], extras: dict[int, int | None], results: dict[int, dict[str, Any]]
) -> tuple[list[int], int]:
    """The order one-at-a-time tracing takes (``base``, then each named ZeRO-1 rank in the order of the
    ranks that named it), as far as the results so far tell, and the index of the first failed rank
    in it (its length when none failed). Ranks already placed never move relative to each other."""
    order = list(base)
    for rank in order:  # (grows while it is walked)
        extra = extras.get(rank)
        if extra is not None and extra not in order:
            order.append(extra)
    failed = (i for i, r in enumerate(order) if r in results and "peak_allocated_bytes" not in results[r])
    return order, next(failed, len(order))


# Host memory one tracing process may take: issue 14's budget for one traced rank.
TRACE_HOST_BYTES = 4 * 2**30


def trace_jobs(n: int) -> int:
    """How many of ``n`` ranks to trace at a time: no more than this process may run on CPUs, nor than
    the host memory now available holds at ``TRACE_HOST_BYTES`` each; at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cpus = os.cpu_count() or 1
    memory = _available_memory_bytes()
    by_memory = n if memory is None else memory // TRACE_HOST_BYTES
    return max(1, min(n, cpus, by_memory))


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _preload() -> None:
    """Import here what every trace imports (a second or more of CPU each), so that the forked tracing
    processes find it done; importing changes nothing they trace."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


PRELOAD = (
    "torch._subclasses.fake_tensor",
    "torch.testing._internal.distributed.fake_pg",
    "torch.distributed._tools.mem_tracker",
    "harness.alloc",
    "harness.runner.fake.ddp",
    "harness.runner.fake.kernels",
    "harness.runner.fake.trace",
    "harness.runner.measure.peak",
    "harness.runner.model",
    "harness.runner.parallel.compose",
)


def _trace_in_child(spec: RunSpec, rank: int, *, deadline: float, kernels: str | None) -> dict[str, Any]:
    """``trace_rank`` in a forked process (a fake process group is per process, and the parent's
    memory stays clean); its result, an error, or ``timed_out``."""
    running: dict[int, tuple[Any, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="harness-fake-") as tmp, _reaped(running):
        running[rank] = _start_child(spec, rank, Path(tmp) / "rank.json", kernels)
        while running:
            ended = _wait_any(running, deadline)
        return ended[rank]


def _start_child(
    spec: RunSpec,
    rank: int,
    out: Path,
    kernels: str | None,
    trace_dir: Path | None = None,
    *,
    keep_events: bool = False,
) -> tuple[Any, Path]:
    ctx = multiprocessing.get_context("fork")
    args = (spec, rank, out, kernels, trace_dir, keep_events, os.getpid())
    proc = ctx.Process(target=_child, args=args, daemon=True)
    proc.start()
    return proc, out


def _wait_any(running: dict[int, tuple[Any, Path]], deadline: float) -> dict[int, dict[str, Any]]:
    """Wait for at least one of the ``running`` tracing processes to end (or the deadline, which ends
    them all); the results of those that ended, removed from ``running``."""
    from multiprocessing.connection import wait

    ended = wait(
        [proc.sentinel for proc, _ in running.values()], timeout=max(1.0, deadline - time.monotonic())
    )
    out = {}
    for rank, (proc, path) in list(running.items()):
        if proc.sentinel not in ended:
            if time.monotonic() < deadline:
                continue
            del running[rank]
            _kill(proc)
            out[rank] = {"rank": rank, "timed_out": True}
            continue
        del running[rank]
        proc.join()  # (it has exited: its sentinel is ready; joining reaps it and sets its exit code)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            sig = -proc.exitcode if proc.exitcode < 0 else None
            why = f"killed by signal {signal.Signals(sig).name}" if sig else f"exit code {proc.exitcode}"
            result = {"rank": rank, "error": f"the tracing process died ({why})"}
        result["exit_code"] = proc.exitcode
        _stopped(rank, result, proc.exitcode)
        out[rank] = result
    return out


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


@contextlib.contextmanager
def _reaped(running: dict[int, tuple[Any, Path]]):
    """Kill the tracing processes still ``running`` when the block ends, however it ends: a SIGTERM
    (``Terminated``) or Ctrl-C in the parent left them tracing on, and writing into a removed directory,
    after the command had said it stopped."""
    try:
        yield
    finally:
        for proc, _ in running.values():
            if proc.exitcode is None:
                _kill(proc)
        running.clear()


def _stopped(rank: int, result: dict[str, Any], exitcode: int | None) -> None:
    """Raise what stopped a tracing process from outside: SIGTERM (its ``Terminated``, or death by the
    signal) or Ctrl-C. Such a rank has no outcome, so neither has the point: no row (a resumed sweep
    traces it again), as a real rank's SIGTERM (outcome.py). Recorded as the rank's error before, it
    became a ``crash`` row and the sweep went on to its next point."""
    why = result.get("stopped") or {-signal.SIGTERM: "Terminated", -signal.SIGINT: "KeyboardInterrupt"}.get(
        exitcode
    )
    if why == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if why == "Terminated":
        raise Terminated(f"SIGTERM reached traced rank {rank}: the point has no outcome")


def _child(
    spec: RunSpec,
    rank: int,
    out: Path,
    kernels: str | None,
    trace_dir: Path | None = None,
    keep_events: bool = False,
    parent_pid: int | None = None,
) -> None:
    """Trace ``rank`` and write its result to ``out``. ``keep_events``: the step's allocation events as
    ``events`` (for the trace cache, which replays them against another card's capacity). Dies with
    ``parent_pid`` (``kill -9`` of a fake sweep left its tracing processes running)."""
    import resource

    from harness.runner.procs import die_with_parent, write_json, write_trace_file

    if parent_pid is not None:
        die_with_parent(parent_pid)
    try:
        start = time.perf_counter()
        keep = trace_dir is not None or keep_events
        result = {"rank": rank, **trace_rank(spec, rank, kernels=kernels, keep_trace=keep)}
        events = result.pop("trace", None)
        if trace_dir is not None:
            trace = {"segments": [], "device_traces": [events]}
            result["trace_file"] = write_trace_file(trace_dir, f"{spec_id(spec)}.rank{rank}", trace)
        elif keep_events and events is not None:
            result["events"] = events
        result["trace_s"] = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds too: on a shared machine the wall time says more about the other processes.
        result["trace_cpu_s"] = usage.ru_utime + usage.ru_stime
        result["host_rss_bytes"] = usage.ru_maxrss * 1024
    except (Terminated, KeyboardInterrupt) as exc:  # stopped from outside: no outcome (_stopped)
        result = {"rank": rank, "stopped": type(exc).__name__}
    except BaseException as exc:  # written as data: the parent turns it into the record's reason
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result = {
            "rank": rank,
            "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500],
            "traceback": traceback.format_exc()[-4000:],
        }
    write_json(out, result)
    os._exit(0)
