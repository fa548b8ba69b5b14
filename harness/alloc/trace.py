"""Allocation traces: reading them from a file (JSON events or a CUDA memory snapshot) and replaying them
through the allocator model to the peaks a GPU would show."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness.alloc.allocator import Block, CachingAllocator, OutOfMemory, ReplayResult

REPLAYED = ("alloc", "free_completed")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the event."""


def replay(
    events: Iterable[dict[str, Any]],
    *,
    capacity_bytes: int | None = None,
    max_split_size_mb: float | None = None,
    expandable_segments: bool = False,
    stop_at: int | None = None,
) -> ReplayResult:
    """Replay ``events`` through the allocator model. An out-of-memory ends the replay (as it ends the
    step on a GPU) with ``num_ooms`` 1 and ``oom_event`` its index. ``stop_at``: stop after that event
    (used to read the segments at the reserved peak). Raises :class:`TraceError` for a malformed event."""
    a = CachingAllocator(
        capacity_bytes=capacity_bytes,
        max_split_size_mb=max_split_size_mb,
        expandable_segments=expandable_segments,
    )
    live: dict[int, Block | None] = {}
    res = ReplayResult()
    i = -1
    for i, ev in enumerate(events):
        action = ev.get("action") if isinstance(ev, dict) else None
        if action not in REPLAYED:
            if action is None:
                raise TraceError(f"event {i}: not an object with an 'action' ({ev!r:.80})")
            continue
        addr, size, stream = ev.get("addr"), ev.get("size", 0), ev.get("stream", 0)
        if not isinstance(addr, int) or isinstance(addr, bool):
            raise TraceError(f"event {i} ({action}): addr {addr!r} is not an integer")
        if action == "alloc":
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise TraceError(f"event {i} (alloc at {addr:#x}): size {size!r} must be an integer >= 0")
            if addr in live:
                raise TraceError(f"event {i}: alloc at {addr:#x}, which is already allocated")
            if size == 0:  # never reaches the allocator (and its free is ignored with it)
                live[addr] = None
                continue
            try:
                live[addr] = a.malloc(size, stream if stream is not None else 0)
            except OutOfMemory:
                res.oom_event = i
                break
            if a.allocated > res.peak_allocated_bytes:
                res.peak_allocated_bytes = a.allocated
            if a.reserved > res.peak_reserved_bytes or (
                a.reserved == res.peak_reserved_bytes and a.allocated > res.allocated_at_reserved_peak_bytes
            ):
                res.peak_reserved_bytes = a.reserved
                res.allocated_at_reserved_peak_bytes = a.allocated
                res.reserved_peak_event = i
        else:
            if addr not in live:
                raise TraceError(f"event {i}: free_completed at {addr:#x}, which was never allocated")
            block = live.pop(addr)
            if block is not None:
                a.free_block(block)
        if stop_at is not None and i >= stop_at:
            res.segments_at_reserved_peak = a.segments_table()
            break
    res.num_events = i + 1
    res.num_alloc_retries = a.retries
    res.num_ooms = a.ooms
    res.num_segments_opened = a.opened
    return res


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file: JSON (a list of events, or a snapshot dict whose ``device_traces``
    holds one list per device; the device with the most events is taken), or a pickle written by
    ``torch.cuda.memory._dump_snapshot`` (unpickling runs code: load only your own files)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    data: Any
    if path.suffix in (".pickle", ".pkl"):
        try:
            data = pickle.loads(raw)  # the user's own snapshot file, as documented
        except Exception as exc:
            raise TraceError(f"{path} is not a readable pickle: {type(exc).__name__}: {exc}") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path} is not JSON: {exc}") from None
    if isinstance(data, dict):
        traces = data.get("device_traces")
        if not isinstance(traces, list):
            raise TraceError(f"{path}: a snapshot dict needs a 'device_traces' list")
        lists = [t for t in traces if isinstance(t, list)]
        data = max(lists, key=len) if lists else []
    if not isinstance(data, list):
        raise TraceError(f"{path}: a trace is a list of events or a snapshot dict")
    return data
