"""Peak memory per rank, measured the same way every time, and labelled with the method.

CUDA: the caching allocator's own statistics (peak allocated, active, reserved bytes; retries and OOMs
of the timed window) and the device's used memory; the window's allocation trace replayed through the
allocator model from the real allocator's state at the window's start, under the allocator settings in
effect (``PeakMemory._cuda_replay``). CPU has no allocator statistics to read, so
(``memory_method=cpu_allocator``) the peak is the c10 CPU allocator's running total over the step, as
``torch.profiler`` records it with ``profile_memory=True``, counted on every thread from the rank's
start (``start_cpu_accounting``; where that could not run, from the step's start plus every tensor
storage then alive, found through the garbage collector). PyTorch's MemTracker runs beside it for the
categories (parameters, gradients, optimizer state, activations, temporaries); its own peak
(``tracker_peak_bytes``) misses what C++ allocates out of its sight, and the difference is reported as
``untracked``. Both slow a step 4-7x, so the runner measures memory on a step of its own. A dry run
(fake tensors, nothing allocated) uses MemTracker only. CPU and fake runs replay the storages the
step's operators make (``REPLAYED_TRACE``), CUDA runs the allocator's own trace.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.alloc.settings import ASYNC_BACKEND, alloc_conf_from_env, replay_settings
from harness.runner.measure.cpu import _AllocatorPeak, accounting_base
from harness.runner.measure.trace import (
    SEGMENT_OPENS,
    _SimulatedStreams,
    history_mark,
    simulated,
    window_start,
)
from harness.runner.measure.tracker import (
    CATEGORY_NAMES,
    _optimizers,
    _tracker_class,
    _untracked_live_tensors,
)

# What a CPU or fake run's ``sim_*`` figures replay (the record's ``sim_trace``): the storages the
# step's operators make and free, as the tracker sees them (what was alive at the step's start first,
# as allocations), on the streams CUDA would allocate them on. Not the CPU allocator's own trace: that
# holds the CPU kernels' scratch (BF16 matmul reorders, the flash-attention kernel's per-thread
# buffers, scalars wrapped inside kernels: 1,935 allocations in a `tiny` step whose operators make
# 927), which a CUDA kernel of the same operator does not ask the caching allocator for, and the blocks of
# the intra-op thread pool, which the profiler sees only as a rising total whose frees are guessed —
# so its replay moved by a segment or two from run to run of one point (`tiny`, BF16, full
# recomputation: 62.9, 65.0 and 67.1 MiB in three runs; 60.8 MiB every time from the operators'
# storages, as its fake run replays). A CUDA run replays the allocator's own trace ("cuda_allocator").
REPLAYED_TRACE = "operator_storages"
CUDA_REPLAYED_TRACE = "cuda_allocator"


class PeakMemory:
    """Context manager around the measured steps; ``result()`` afterwards."""

    def __init__(
        self,
        modules: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        allocator: bool = True,
    ):
        """``allocator=False``: MemTracker alone (fake tensors in a dry run allocate nothing)."""
        self.device = device
        self.allocator = allocator
        self.modules = modules
        self.optimizer = optimizer
        self.tracker = None
        self._result: dict[str, Any] = {}
        self.trace: dict[str, Any] | None = None  # the step's allocation trace, a snapshot-shaped dict
        # What the caching allocator may reserve on the card the trace is replayed for (the device's
        # memory less what lives outside the allocator): its replay is then also judged against it.
        self.capacity_bytes: int | None = None

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = _cuda_window_start(self.device)
            before = torch.cuda.memory_stats(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._result = {
                "memory_method": "cuda_caching_allocator",
                "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
                "peak_active_bytes": stats.get("active_bytes.all.peak", 0),
                "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
                # Cumulative from the process's start (the allocator's "accumulated" stats): the
                # window's are the difference. Not reset_accumulated_memory_stats, which would also
                # zero every allocation and free count (torch/cuda/memory.py) for whoever reads them.
                "num_alloc_retries": _delta(stats, before, "num_alloc_retries"),
                "num_ooms": _delta(stats, before, "num_ooms"),
                "device_used_bytes": total - free,
                "categories": {},
                **cuda_versions(),
            }
            self._result.update(self._cuda_replay(start))
            return
        tracker = _tracker_class()()
        tracker.track_external(*self.modules, *_optimizers(self.optimizer))
        # Then every other storage already alive: MemTracker counts only what it sees created or is
        # given, and what earlier steps left (pipeline receive buffers, DDP's gradient buckets, which
        # the gradients are views of) would be missing from its peak. They start as "other"; a bucket
        # turns "grads" when backward hands out its views.
        tracker.track_external(*_untracked_live_tensors(tracker, self.device, fake=not self.allocator))
        baseline = int(tracker.get_tracker_snapshot().get(self.device, {}).get("Total", 0))
        # The replayed trace is the storages the step's operators make and free, as the tracker sees
        # them, in real and fake runs alike (``REPLAYED_TRACE`` says why).
        tracker.start_trace(_SimulatedStreams(self.modules))
        self.tracker = tracker
        allocator = _AllocatorPeak() if self.allocator else contextlib.nullcontext()
        with allocator, tracker:
            yield
        self.tracker = None
        peak = tracker.get_tracker_snapshot("peak").get(self.device, {})
        categories: dict[str, int] = {}
        for key, value in peak.items():
            name = CATEGORY_NAMES.get(str(getattr(key, "value", key)), str(key).lower())
            if name != "total":
                categories[name] = categories.get(name, 0) + int(value)
        tracked = int(peak.get("Total", sum(categories.values())))
        if not self.allocator:
            self._result = {"memory_method": "mem_tracker", "peak_allocated_bytes": tracked}
        else:
            # The allocator's count is the peak; MemTracker's categories say what it was made of. They
            # differ where C++ code allocates out of the tracker's sight ("untracked").
            base = accounting_base()
            if base is not None and allocator.max_total is not None:
                total = allocator.max_total - base
            else:  # counted from the step's start: what was alive then is assumed alive throughout
                total = baseline + allocator.peak_bytes
            categories["untracked"] = max(0, total - tracked)
            self._result = {
                "memory_method": "cpu_allocator",
                "peak_allocated_bytes": total,
                "tracker_peak_bytes": tracked,
            }
        events, tracker.trace_events = tracker.trace_events or [], None
        self.trace = {"segments": [], "device_traces": [events]}
        self._result["sim_trace"] = REPLAYED_TRACE
        self._simulate(events)
        self._result["categories"] = categories

    def _cuda_replay(self, start: dict[str, Any] | None) -> dict[str, Any]:
        """The timed window replayed through the allocator model under the settings in effect.

        The window is what the measured peaks cover: from ``reset_peak_memory_stats`` at the measured
        steps' start to their end. Its replay starts from the allocator's real state at that start
        (every segment and block of a snapshot taken there, so the cache the warm-up steps left is in
        it, as it is in the measured reserved peak) and replays the window's events only; the peaks
        start at that state, as reset_peak_memory_stats sets them to the current values. (A replay
        of the live blocks alone, as CPU runs replay (``REPLAYED_TRACE``), would start from an empty
        cache and open the segments the real allocator had cached: neither its reserved peak nor its
        segment count would compare.) ``sim_*`` stay empty, with ``sim_skipped_reason``, where the
        settings hold something the model lacks, no history was recorded, or the model refuses the
        trace."""
        device = self.device.index if self.device.index is not None else torch.cuda.current_device()
        info = allocator_info()
        out: dict[str, Any] = {k: v for k, v in info.items() if k != "snapshot_settings"}
        out["sim_trace"] = CUDA_REPLAYED_TRACE
        if start is None:
            reason = info.get("skipped") or "no allocation history recorded (start_cuda_history not run)"
            return {**out, "sim_skipped_reason": reason}
        snap = torch.cuda.memory._snapshot()
        settings = snap.get("allocator_settings")
        if isinstance(settings, dict):
            info = allocator_info(settings)
            out = {k: v for k, v in info.items() if k != "snapshot_settings"}
            out["sim_trace"] = CUDA_REPLAYED_TRACE
        traces = snap.get("device_traces") or []
        events = traces[device] if device < len(traces) else []
        begin = window_start(events, start["mark"])
        window = events[begin:] if begin is not None else []
        out["segment_allocs_measured"] = sum(1 for ev in window if ev.get("action") in SEGMENT_OPENS)
        self.trace = {
            "segments": snap.get("segments", []),  # at the window's end, as in a snapshot
            "initial_segments": start["segments"],  # at its start: the replay's initial state
            "device_traces": [window],
            "allocator_settings": settings,
        }
        if begin is None:
            out["segment_allocs_measured"] = None
            return {**out, "sim_skipped_reason": "the allocation history no longer holds the window's start"}
        if info.get("skipped"):
            return {**out, "sim_skipped_reason": info["skipped"]}
        try:
            out.update(
                simulated(
                    window,
                    initial_segments=start["segments"],
                    expandable_segments=out["sim_expandable_segments"],
                    max_split_size_mb=out["sim_max_split_size_mb"],
                )
            )
        except ValueError as e:  # harness.alloc.TraceError (and a setting the model refuses)
            out["sim_skipped_reason"] = f"the allocator model refuses the trace: {e}"
        return out

    def _simulate(self, events: list[dict[str, Any]]) -> None:
        try:
            self._result.update(simulated(events, capacity_bytes=self.capacity_bytes))
        except ValueError as e:  # harness.alloc.TraceError: the reconstruction's fault, not the run's
            import sys

            reason = f"the step's allocation trace does not replay ({e})"
            self._result["sim_skipped_reason"] = reason  # (a row without sim_* said nothing of why)
            print(f"warning: {reason}; no sim_* figures", file=sys.stderr)

    def result(self) -> dict[str, Any]:
        return dict(self._result)


_cuda_history = False  # whether start_cuda_history ran in this (rank) process


def start_cuda_history(*, stacks: bool = False) -> None:
    """Record the CUDA caching allocator's history from here on. ``stacks``: Python frames for memory_viz
    (costs time); without them only sizes and addresses are kept. The replay needs only the measured
    window's events (its start state is read from a snapshot there), so the ring of ``max_entries``
    must hold the window. Nothing under the cudaMallocAsync backend, whose ``recordHistory`` raises
    (c10/cuda/CUDAMallocAsyncAllocator.cpp)."""
    if _allocator_backend() == ASYNC_BACKEND:
        return
    torch.cuda.memory._record_memory_history(
        context="all" if stacks else None, stacks="python", max_entries=5_000_000
    )
    global _cuda_history
    _cuda_history = True


def _cuda_window_start(device: torch.device) -> dict[str, Any] | None:
    """The allocator's state where the window starts: its segments (the replay's initial state) and a
    mark of the history's end there (:func:`window_start`); None without a history."""
    if not _cuda_history:
        return None
    snap = torch.cuda.memory._snapshot()
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = snap.get("device_traces") or []
    events = traces[index] if index < len(traces) else []
    segments = [s for s in snap.get("segments", []) if s.get("device", index) == index]
    return {"segments": segments, "mark": history_mark(events)}


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _allocator_backend() -> str | None:
    """``torch.cuda.get_allocator_backend()`` ("native" or "cudaMallocAsync"); None where absent."""
    get = getattr(torch.cuda, "get_allocator_backend", None)
    try:
        return get() if get is not None else None
    except RuntimeError:
        return None


def allocator_info(snapshot_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The allocator settings in effect, as rank-result fields: the backend, the settings string
    (the snapshot's when given, which is what the allocator parsed; else the environment's, in torch's
    order: harness.alloc.settings), both environment variables as set, and what the replay runs with
    (``sim_expandable_segments``, ``sim_max_split_size_mb``) or why it cannot (``skipped``)."""
    backend = _allocator_backend()
    name, conf = alloc_conf_from_env(os.environ)
    source = name
    if snapshot_settings is not None and isinstance(snapshot_settings.get("PYTORCH_CUDA_ALLOC_CONF"), str):
        conf, source = snapshot_settings["PYTORCH_CUDA_ALLOC_CONF"], "snapshot"
    rs = replay_settings(backend=backend, snapshot_settings=snapshot_settings, conf=conf)
    return {
        "allocator_backend": backend,
        "allocator_settings": conf,
        "allocator_settings_source": source,
        "env_pytorch_alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF"),
        "env_pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "sim_expandable_segments": rs.expandable_segments,
        "sim_max_split_size_mb": rs.max_split_size_mb,
        "skipped": rs.skipped,
    }


def cuda_versions() -> dict[str, Any]:
    """cuDNN and NCCL versions as this rank loaded them (CUDA is initialised here already:
    ``torch.backends.cudnn.version()`` calls ``torch.cuda.get_device_capability``, which initialises
    CUDA, so the supervisor leaves these to the ranks)."""
    out: dict[str, Any] = {"env_cuda_version": torch.version.cuda}
    try:
        out["env_cudnn_version"] = torch.backends.cudnn.version()
    except (RuntimeError, AttributeError):
        out["env_cudnn_version"] = None
    try:
        out["env_nccl_version"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError, TypeError):
        out["env_nccl_version"] = None
    return out


def cpu_peak_tflops(dtype: torch.dtype, *, size: int = 512, repeats: int = 3) -> float:
    """This process's dense matmul rate in ``dtype`` on the CPU (median of ``repeats``), the MFU
    reference on CPU. Measured per run in the run's compute dtype: on CPUs without native BF16 a BF16
    matmul is ~80× slower than FP32 (seen on this project's machines), so no fixed figure is right."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * size**3 / times[len(times) // 2] / 1e12
