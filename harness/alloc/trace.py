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


# What a trace does on a card whose allocator may reserve ``capacity_bytes`` (issue 32): it fits; it fits
# only because the allocator released its cache and retried (``num_alloc_retries``: each a
# synchronising cudaFree of every unused cached segment, slower); it runs out of memory although its
# tensors alone would fit (fragmentation: the reserved level does not fit even after the flush); or
# its tensors alone do not fit.
CAPACITY_VERDICTS = ("fits", "fits_after_flush", "oom_fragmentation", "oom_allocated")


def capacity_verdict(bounded: ReplayResult, capacity_bytes: int, *, peak_allocated_bytes: int) -> str:
    """One of :data:`CAPACITY_VERDICTS` for a trace whose replay against ``capacity_bytes`` is
    ``bounded`` (its ``num_alloc_retries`` are the cache flushes before the step ended or ran out).
    ``peak_allocated_bytes``: the tensors' own peak, from an unbounded replay (the bounded one's, when it
    did not run out, is the same), which tells an out-of-memory by fragmentation from one at the
    allocated level."""
    if bounded.num_ooms:
        return "oom_fragmentation" if peak_allocated_bytes <= capacity_bytes else "oom_allocated"
    return "fits_after_flush" if bounded.num_alloc_retries else "fits"


def replay(
    events: Iterable[dict[str, Any]],
    *,
    capacity_bytes: int | None = None,
    max_split_size_mb: float | None = None,
    expandable_segments: bool = False,
    stop_at: int | None = None,
    initial_segments: list[dict[str, Any]] | None = None,
) -> ReplayResult:
    """Replay ``events`` through the allocator model. An out-of-memory ends the replay (as it ends the
    step on a GPU) with ``num_ooms`` 1 and ``oom_event`` its index. ``stop_at``: stop after that event
    (used to read the segments at the reserved peak). ``initial_segments``: the state to start from, as
    ``torch.cuda.memory._snapshot()["segments"]`` gives it (:func:`seed`); the peaks then start at that
    state's allocated and reserved bytes, as ``torch.cuda.reset_peak_memory_stats`` sets them to the
    current ones. Raises :class:`TraceError` for a malformed event."""
    a = CachingAllocator(
        capacity_bytes=capacity_bytes,
        max_split_size_mb=max_split_size_mb,
        expandable_segments=expandable_segments,
    )
    live: dict[int, Block | None] = {}
    res = ReplayResult()
    if initial_segments:
        live.update(seed(a, initial_segments))
        res.peak_allocated_bytes = res.allocated_at_reserved_peak_bytes = a.allocated
        res.peak_reserved_bytes = a.reserved
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
        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise TraceError(f"event {i} ({action} at {addr:#x}): stream {stream!r} is not an integer")
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


# Block states of a snapshot whose memory is not free to reuse: "active_allocated", and a block freed by
# the program that another stream still uses ("active_awaiting_free" in torch/cuda/memory.py
# ``_snapshot``'s docstring, "active_pending_free" in the C++ that fills it): its trace has the
# ``free_completed`` still to come, where the model frees it.
_HELD_STATES = ("active_allocated", "active_awaiting_free", "active_pending_free")


def seed(a: CachingAllocator, segments: list[dict[str, Any]]) -> dict[int, Block]:
    """Put a snapshot's ``segments`` (torch/cuda/memory.py ``_snapshot``: ``address``, ``total_size``,
    ``stream``, ``segment_type`` small|large, ``blocks`` with ``size``, ``requested_size``, ``state``
    and, from torch 2.1, ``address``; ``is_expandable``) into ``a``; the held blocks by address. Segments
    of private pools (CUDA graphs, ``segment_pool_id`` other than (0, 0)) are left out: the trace's
    events are the default pool's."""
    held: dict[int, Block] = {}
    for i, seg in enumerate(segments):
        try:
            if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
                continue
            addr = int(seg["address"])
            blocks, at = [], addr
            for b in seg["blocks"]:
                size = int(b["size"])
                b_addr = int(b.get("address", at))
                allocated = b.get("state") in _HELD_STATES
                blocks.append((b_addr, size, allocated, int(b.get("requested_size", size))))
                at = b_addr + size
            small = seg.get("segment_type") == "small"
            stream = int(seg.get("stream", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"initial segment {i}: {type(exc).__name__}: {exc}") from None
        for block in a.seed_segment(
            addr=addr, stream=stream, small=small, blocks=blocks, expandable=bool(seg.get("is_expandable"))
        ):
            held[block.addr] = block
    return held


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file: JSON (a list of events, or a snapshot dict whose ``device_traces``
    holds one list per device; the device with the most events is taken), or a pickle written by
    ``torch.cuda.memory._dump_snapshot`` (unpickling runs code: load only your own files)."""
    return load_trace_file(path)[0]


def load_trace_file(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """:func:`load_trace`'s events, and the allocator's state they start from where the file holds one
    (``initial_segments``: a CUDA run's trace of its timed window, harness/runner/measure/peak.py), to
    pass to :func:`replay` as ``initial_segments``; None for a trace that starts from nothing."""
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
        except RecursionError:
            raise TraceError(f"{path}: JSON nested too deeply to be a trace") from None
    initial = None
    if isinstance(data, dict):
        traces = data.get("device_traces")
        if not isinstance(traces, list):
            raise TraceError(f"{path}: a snapshot dict needs a 'device_traces' list")
        initial = data.get("initial_segments")
        if initial is not None and not isinstance(initial, list):
            raise TraceError(f"{path}: 'initial_segments' must be a list of segments")
        lists = [t for t in traces if isinstance(t, list)]
        data = max(lists, key=len) if lists else []
    if not isinstance(data, list):
        raise TraceError(f"{path}: a trace is a list of events or a snapshot dict")
    return data, initial
