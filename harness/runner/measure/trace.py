"""Traces: the CUDA stream each allocation would be made on, the CPU allocator's events in the order it
saw them, and a step's trace replayed through the caching-allocator model (harness/alloc)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The CUDA stream each traced allocation would be made on. The caching allocator keeps cached blocks per
# (stream, pool) and never hands one stream's free block to another (harness/alloc), so where an
# allocation is made changes the reserved peak. CUDA runs read the streams from the allocator's own
# trace; CPU and fake runs know them from FSDP2, which enters its streams through the device handle
# (``torch.cpu`` on CPU: ``torch.cpu.stream(s)`` really sets ``torch.cpu.current_stream()``, torch 2.13
# torch/cpu/__init__.py StreamContext), so the stream current while an op allocates is the one CUDA
# would allocate on (``_SimulatedStreams``). FSDP2's streams (torch 2.13, torch/distributed/fsdp/
# _fully_shard/_fsdp_param_group.py FSDPCommContext.lazy_init) and what each allocates
# (_fsdp_collectives.py):
# - all_gather_copy_in_stream: ``foreach_all_gather`` allocates the all-gather output (and casts of the
#   inputs under a mixed-precision policy) inside ``device_handle.stream(all_gather_copy_in_stream)``,
#   in forward and for backward's first all-gather of each group (``get_all_gather_streams``; explicit
#   prefetches use the current stream);
# - reduce_scatter_stream: ``foreach_reduce`` allocates ``reduce_output`` (the sharded gradients are
#   views of it) and any cast of it inside ``device_handle.stream(reduce_scatter_stream)``; its
#   ``reduce_scatter_input`` is on the current stream;
# - all_reduce_stream: the post-reduce work of HSDP and of ``replicate`` (FSDP2's data-parallel
#   replication, used for pipeline ZeRO-0) and an all-reduce hook, which allocates only a cast of the
#   reduced gradients to the parameters' dtype (``replicate``'s own ``reduce_output`` is made on the
#   reduce-scatter stream: tiny, pp 2 × dp 2, ZeRO-0 has 3 allocations on stream 2 and none on 3);
# - all_gather_stream: the collective only (nothing is allocated on it).
# Each FSDP2 root has a comm context of its own (a rank with several pipeline stages has several); on CUDA
# each stream comes from the device's stream pool, so each root's are distinct: root k's streams are the
# ids below plus ``_STREAMS_PER_ROOT * k``. A side stream none of these owns gets an id from
# ``_OTHER_STREAMS``.
# DDP allocates nothing on a side stream: its reducer allocates the flat gradient buckets with
# ``at::empty`` on the current (default) stream when it builds or rebuilds them (torch/csrc/distributed/
# c10d/reducer.cpp ``Reducer::initialize_buckets``) and all-reduces them in place; ProcessGroupNCCL runs
# the collective on its NCCL stream but allocates nothing there, and its ``recordStream`` on the input
# (ProcessGroupNCCL.cpp ``collective``, unless TORCH_NCCL_AVOID_RECORD_STREAMS holds the tensor instead)
# only delays the reuse of the block, which stays in its own stream's pool. So everything DDP allocates is
# on stream 0, as CUDA's own trace of a DDP step shows. The CPU-only blocks of gloo (its copies of
# collective inputs, made inside the collective where the tracker does not see) are not in a real run's
# replayed trace; a fake run's emulations of them (runner/fake/modes.py) are, on stream 0.
DEFAULT_STREAM = 0
FSDP_ALL_GATHER_STREAM = 1  # all_gather_copy_in_stream
FSDP_REDUCE_SCATTER_STREAM = 2  # reduce_scatter_stream
FSDP_ALL_REDUCE_STREAM = 3  # all_reduce_stream
FSDP_ALL_GATHER_COMM_STREAM = 4  # all_gather_stream
_FSDP_STREAM_IDS = {
    "all_gather_copy_in_stream": FSDP_ALL_GATHER_STREAM,
    "reduce_scatter_stream": FSDP_REDUCE_SCATTER_STREAM,
    "all_reduce_stream": FSDP_ALL_REDUCE_STREAM,
    "all_gather_stream": FSDP_ALL_GATHER_COMM_STREAM,
}
_STREAMS_PER_ROOT = 4
_OTHER_STREAMS = 1000


class _SimulatedStreams:
    """Called, the id of the stream CUDA would allocate on now (see the stream constants above): 0 on the
    default stream, else the FSDP2 stream of ``modules`` that is current. Made where the default stream is
    current (the measured step's start)."""

    def __init__(self, modules: list[nn.Module]):
        self._modules = modules
        self._default = torch.cpu.current_stream()
        self._ids: dict[int, tuple[object, int]] = {}  # id(stream) → (stream, its id); the stream is kept
        self._roots = 0
        self._others = 0

    def __call__(self) -> int:
        current = torch.cpu.current_stream()
        if current is self._default:
            return DEFAULT_STREAM
        known = self._ids.get(id(current))
        if known is None:
            self._find_fsdp_streams()
            known = self._ids.get(id(current))
        if known is None:
            known = self._ids[id(current)] = (current, _OTHER_STREAMS + self._others)
            self._others += 1
        return known[1]

    def _find_fsdp_streams(self) -> None:
        # The comm contexts exist once FSDP2 has run its lazy init (at the first forward); each root's
        # states share one (FSDPState._lazy_init), new roots are numbered in the order they are found.
        from torch.distributed._composable_state import _get_module_state

        for root in self._modules:
            for module in root.modules():
                ctx = getattr(_get_module_state(module), "_comm_ctx", None)
                streams = [(getattr(ctx, name, None), sid) for name, sid in _FSDP_STREAM_IDS.items()]
                if any(s is None or id(s) in self._ids for s, _ in streams):
                    continue  # not FSDP2's, not initialised yet, or already numbered
                for s, sid in streams:
                    self._ids[id(s)] = (s, sid + _STREAMS_PER_ROOT * self._roots)
                self._roots += 1


def _order_by_total(found: list[tuple]) -> None:
    """Put the events back in the order the c10 total says they happened (in place). A profiler event's
    time is taken after the allocator's lock is released, so a thread preempted in between records it
    late (by 1.2 ms, seen on a tp 2 x pp 2 rank on 2 cores): at each place, the first event of the next
    few that follows from the running total goes there; where none does, something happened on an
    unseen thread and time order stands. ``found``: (time, index, ptr, size, total, event), by time."""
    if not found:
        return
    running = found[0][4] - found[0][3]
    for i in range(len(found)):
        for j in range(i, min(len(found), i + _REORDER_EVENTS)):
            if found[j][0] - found[i][0] > _REORDER_NS:
                break
            if found[j][4] - found[j][3] == running:
                if j != i:
                    found.insert(i, found.pop(j))
                break
        running = found[i][4]


# How far an event may have been recorded late: the next 32 events within 20 ms.
_REORDER_EVENTS = 32
_REORDER_NS = 20_000_000


def _trace_event(action: str, addr: int, size: int, stream: int, time_ns: int = 0) -> dict[str, Any]:
    """One event as in ``torch.cuda.memory._snapshot()["device_traces"][i]``."""
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": stream,
        "time_us": time_ns // 1000,
        "frames": [],
    }


def simulated(
    events: list[dict[str, Any]],
    *,
    initial_segments: list[dict[str, Any]] | None = None,
    expandable_segments: bool = False,
    max_split_size_mb: float | None = None,
    capacity_bytes: int | None = None,
) -> dict[str, Any]:
    """The step's trace replayed through the CUDA caching-allocator model (harness/alloc): the
    reserved peak a GPU would show and its fragmentation, no capacity (out of memory is judged later).
    ``capacity_bytes`` (what the allocator may reserve on the card): the trace replayed once more
    against it, ``sim_capacity_verdict`` (harness.alloc.CAPACITY_VERDICTS) and
    ``sim_num_alloc_retries`` (the cache flushes it took), issue 32.
    ``initial_segments``: the allocator's state at the trace's start (CUDA: read from a snapshot);
    ``expandable_segments``/``max_split_size_mb``: the allocator settings the trace was made under.
    ``sim_segments_opened``: the segments the replay opened (with expandable segments: the times it
    mapped more pages), the counterpart of the trace's own ``segment_alloc``/``segment_map`` events."""
    from harness.alloc import replay

    options = dict(
        initial_segments=initial_segments,
        expandable_segments=expandable_segments,
        max_split_size_mb=max_split_size_mb,
    )
    r = replay(events, **options)
    out = {
        "sim_peak_allocated_bytes": r.peak_allocated_bytes,
        "sim_peak_reserved_bytes": r.peak_reserved_bytes,
        "sim_fragmentation_bytes": r.fragmentation_bytes,
        "sim_segments_opened": r.num_segments_opened,
        "trace_events": r.num_events,
    }
    if capacity_bytes is not None and capacity_bytes > 0:
        out.update(
            capacity_fields(events, capacity_bytes, peak_allocated_bytes=r.peak_allocated_bytes, **options)
        )
    return out


def capacity_fields(
    events: list[dict[str, Any]], capacity_bytes: int, *, peak_allocated_bytes: int, **options
) -> dict[str, Any]:
    """The ``sim_capacity_*`` fields of :func:`simulated`: ``events`` replayed against ``capacity_bytes``
    (``options`` as for :func:`harness.alloc.replay`); ``peak_allocated_bytes`` from the unbounded
    replay."""
    from harness.alloc import capacity_verdict, replay

    bounded = replay(events, capacity_bytes=capacity_bytes, **options)
    return {
        "sim_capacity_bytes": capacity_bytes,
        "sim_capacity_verdict": capacity_verdict(
            bounded, capacity_bytes, peak_allocated_bytes=peak_allocated_bytes
        ),
        "sim_num_alloc_retries": bounded.num_alloc_retries,
    }


# The actions of a CUDA trace by which the allocator takes memory from the device: ``segment_alloc``
# (cudaMalloc of a new segment) and ``segment_map`` (pages mapped onto an expandable segment;
# CUDACachingAllocator.cpp ``map_block`` records it, no segment_alloc).
SEGMENT_OPENS = ("segment_alloc", "segment_map")


def _event_key(ev: dict[str, Any]) -> tuple:
    return (ev.get("action"), ev.get("addr"), ev.get("size"), ev.get("stream"), ev.get("time_us"))


def history_mark(events: list[dict[str, Any]]) -> tuple[int, tuple | None]:
    """What marks the end of ``events`` (a device's trace at the window's start) for
    :func:`window_start`: their number and the last one."""
    return len(events), (_event_key(events[-1]) if events else None)


def window_start(events: list[dict[str, Any]], mark: tuple[int, tuple | None]) -> int | None:
    """The index in ``events`` (the same device's trace, read later) of the first event after ``mark``
    (:func:`history_mark`). The history is a ring of ``max_entries`` (torch/cuda/memory.py
    ``_record_memory_history``): once full, old events are dropped from its front, so the mark is
    looked for at and before its old place; None when it is gone (the window's start was overwritten)."""
    n, last = mark
    if last is None:
        return 0 if n == 0 else None
    for i in range(min(n, len(events)) - 1, -1, -1):
        if _event_key(events[i]) == last:
            return i + 1
    return None
