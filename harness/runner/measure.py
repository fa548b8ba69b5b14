"""Peak memory per rank, measured the same way every time, and labelled with the method.

CUDA: the caching allocator's own statistics (peak allocated, active, reserved bytes, retries, OOMs) and
the device's used memory. CPU has no allocator statistics to read, so (``memory_method=cpu_allocator``)
the peak is the c10 CPU allocator's running total over the step, as ``torch.profiler`` records it with
``profile_memory=True``, plus every tensor storage alive when the step starts (found through the
garbage collector: storage that only C++ objects hold at that moment would be missed). PyTorch's
MemTracker runs beside it for the categories (parameters, gradients, optimizer state, activations,
temporaries); its own peak (``tracker_peak_bytes``) misses what C++ allocates, such as DDP's bucket
rebuild, and the difference is reported as ``untracked``. Both slow a step 4-7x, so the runner
measures memory on a step of its own. A dry run (fake tensors, nothing allocated) uses MemTracker only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

CATEGORY_NAMES = {
    # MemTracker / FSDPMemTracker category → record name
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "Optstate": "optimizer",
    "Inputs": "inputs",
    "Other": "other",
}


def _tracker_class():
    """PyTorch's MemTracker, accepting a root module called once per micro-batch.

    MemTracker refuses a root module's second forward in one tracked region ("multiple iterative calls"),
    which is what gradient accumulation and every pipeline schedule do. Only the global peak is used
    here, not per-module statistics, so the root's module statistics are dropped before its next forward
    (what ``reset_mod_stats`` does for all modules, done for the root alone). FSDPMemTracker is not used:
    it refuses the same in a hook of its own, and MemTracker already follows FSDP2's ``resize_`` of
    unsharded parameters, so its totals stand without it.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return Tracker


def _optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose ``state`` holds this rank's optimizer tensors. MemTracker counts a tensor
    made before tracking starts only if it is registered; ``ZeroRedundancyOptimizer`` keeps its
    shard's state in a local optimizer (``.optim``) and its own ``state`` stays empty, so without this
    the ZeRO-1 state was missing from every measured peak (the allocator check showed -18.6 %)."""
    local = getattr(optimizer, "optim", None)
    return [optimizer, local] if isinstance(local, torch.optim.Optimizer) else [optimizer]


def _untracked_live_tensors(tracker: Any, device: torch.device) -> list[torch.Tensor]:
    """One tensor per live storage on ``device`` that ``tracker`` does not know yet (DTensors by their
    local shard), found through the garbage collector: what an allocator-level count would include.
    Fake tensors count too: in a dry run they stand for the real rank's storages (pipeline buffers made
    in the warm-up step)."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    gc.collect()
    known, seen, found = tracker._WINFO, set(), []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # (isinstance would wake deprecated module proxies)
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if not (type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, FakeTensor)):
            continue
        if t.device != device or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st in known or st._cdata in seen:
            continue
        seen.add(st._cdata)  # (not data_ptr: every fake storage has none)
        found.append(t)
    return found


class _AllocatorPeak:
    """The CPU allocator's own running total: ``torch.profiler`` with ``profile_memory=True`` records
    every allocation with the c10 allocator's total since the profiler started; ``peak_bytes`` is the
    largest (0 if nothing was allocated). What was alive at the start must be added by the caller."""

    def __enter__(self) -> _AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self.peak_bytes = 0
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                self.peak_bytes = max(self.peak_bytes, int(event.extra_fields.total_allocated))


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
            return
        tracker = _tracker_class()()
        tracker.track_external(*self.modules, *_optimizers(self.optimizer))
        # Then every other storage already alive: MemTracker counts only what it sees created or is
        # given, and what earlier steps left (pipeline receive buffers, DDP's gradient buckets, which
        # the gradients are views of) would be missing from its peak. They start as "other"; a bucket
        # turns "grads" when backward hands out its views.
        tracker.track_external(*_untracked_live_tensors(tracker, self.device))
        baseline = int(tracker.get_tracker_snapshot().get(self.device, {}).get("Total", 0))
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
            # differ where C++ code allocates out of the tracker's sight: DDP's reducer rebuilds its
            # gradient buckets in the second step's forward while the first ones are still alive.
            total = baseline + allocator.peak_bytes
            categories["untracked"] = max(0, total - tracked)
            self._result = {
                "memory_method": "cpu_allocator",
                "peak_allocated_bytes": total,
                "tracker_peak_bytes": tracked,
            }
        self._result["categories"] = categories

    def result(self) -> dict[str, Any]:
        return dict(self._result)


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
