"""Peak memory per rank, measured the same way every time, and labelled with the method.

CUDA: the caching allocator's own statistics (peak allocated, active, reserved bytes, retries, OOMs) and
the device's used memory. CPU has no allocator statistics: PyTorch's MemTracker tracks live tensors by
category (and FSDP2's storage resizes) at ~7 % run-time overhead.
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


class PeakMemory:
    """Context manager around the measured steps; ``result()`` afterwards."""

    def __init__(self, modules: list[nn.Module], optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
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
        tracker.track_external(*self.modules, self.optimizer)
        method = "mem_tracker"
        self.tracker = tracker
        with tracker:
            yield
        self.tracker = None
        peak = tracker.get_tracker_snapshot("peak").get(self.device, {})
        categories: dict[str, int] = {}
        for key, value in peak.items():
            name = CATEGORY_NAMES.get(str(getattr(key, "value", key)), str(key).lower())
            if name != "total":
                categories[name] = categories.get(name, 0) + int(value)
        self._result = {
            "memory_method": method,
            "peak_allocated_bytes": int(peak.get("Total", sum(categories.values()))),
            "categories": categories,
        }

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
