"""Peak memory per rank, measured the same way every time, and labelled with the method.

CUDA: the caching allocator's own statistics (peak allocated, active, reserved bytes, retries, OOMs) and
the device's used memory. CPU has no allocator statistics to read, so (``memory_method=cpu_allocator``)
the peak is the c10 CPU allocator's running total over the step, as ``torch.profiler`` records it with
``profile_memory=True``, counted on every thread from the rank's start (``start_cpu_accounting``; where
that could not run, from the step's start plus every tensor storage then alive, found through the
garbage collector). PyTorch's MemTracker runs beside it for the categories (parameters, gradients,
optimizer state, activations, temporaries); its own peak (``tracker_peak_bytes``) misses what C++
allocates out of its sight, and the difference is reported as ``untracked``. Both slow a step 4-7x,
so the runner measures memory on a step of its own. A dry run (fake tensors, nothing allocated) uses
MemTracker only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.runner.measure.cpu import _AllocatorPeak, accounting_base
from harness.runner.measure.trace import _SimulatedStreams, simulated, step_trace
from harness.runner.measure.tracker import (
    CATEGORY_NAMES,
    _optimizers,
    _tracker_class,
    _untracked_live_tensors,
    live_storages,
)


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

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
                "num_alloc_retries": stats.get("num_alloc_retries", 0),
                "num_ooms": stats.get("num_ooms", 0),
                "device_used_bytes": total - free,
                "categories": {},
            }
            if _cuda_history:  # see start_cuda_history
                snap = torch.cuda.memory._snapshot()
                events = snap["device_traces"][self.device.index or 0]
                self.trace = {"segments": snap["segments"], "device_traces": [events]}
                self._result.update(simulated(events))
            return
        tracker = _tracker_class()()
        tracker.track_external(*self.modules, *_optimizers(self.optimizer))
        # Then every other storage already alive: MemTracker counts only what it sees created or is
        # given, and what earlier steps left (pipeline receive buffers, DDP's gradient buckets, which
        # the gradients are views of) would be missing from its peak. They start as "other"; a bucket
        # turns "grads" when backward hands out its views.
        tracker.track_external(*_untracked_live_tensors(tracker, self.device, fake=not self.allocator))
        baseline = int(tracker.get_tracker_snapshot().get(self.device, {}).get("Total", 0))
        start_live = live_storages(self.device) if self.allocator else []
        streams = _SimulatedStreams(self.modules)
        if self.allocator:
            tracker.start_stream_log(streams)
        else:
            tracker.start_trace(streams)
        self.tracker = tracker
        allocator = _AllocatorPeak() if self.allocator else contextlib.nullcontext()
        if self.allocator:
            allocator.stream_log = tracker.stream_log
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
            events, tracker.trace_events = tracker.trace_events or [], None
            self.trace = {"segments": [], "device_traces": [events]}
            self._simulate(events)
        else:
            # The allocator's count is the peak; MemTracker's categories say what it was made of. They
            # differ where C++ code allocates out of the tracker's sight ("untracked").
            held_elsewhere = 0
            base = accounting_base()
            if base is not None and allocator.max_total is not None:
                total = allocator.max_total - base
                held_elsewhere = allocator.start_total - base - sum(n for _, n in start_live)
            else:  # counted from the step's start: what was alive then is assumed alive throughout
                total = baseline + allocator.peak_bytes
            categories["untracked"] = max(0, total - tracked)
            self._result = {
                "memory_method": "cpu_allocator",
                "peak_allocated_bytes": total,
                "tracker_peak_bytes": tracked,
            }
            events = step_trace(start_live, allocator.events, held_elsewhere=held_elsewhere)
            self.trace = {"segments": [], "device_traces": [events]}
            self._simulate(events)
        self._result["categories"] = categories

    def _simulate(self, events: list[dict[str, Any]]) -> None:
        try:
            self._result.update(simulated(events))
        except ValueError as e:  # harness.alloc.TraceError: the reconstruction's fault, not the run's
            import sys

            print(
                f"warning: the step's allocation trace does not replay ({e}); no sim_* figures",
                file=sys.stderr,
            )

    def result(self) -> dict[str, Any]:
        return dict(self._result)


_cuda_history = False  # whether start_cuda_history ran in this (rank) process


def start_cuda_history(*, stacks: bool = False) -> None:
    """Record the CUDA caching allocator's history from here on (call before the model is built, so the
    trace holds every block the measured steps see). ``stacks``: Python frames for memory_viz (costs
    time); without them only sizes and addresses are kept."""
    torch.cuda.memory._record_memory_history(
        context="all" if stacks else None, stacks="python", max_entries=5_000_000
    )
    global _cuda_history
    _cuda_history = True


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
