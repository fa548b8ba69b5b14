"""The CPU allocator's own accounting: c10's running total over a step, on every thread, read through
``torch.profiler`` (``memory_method=cpu_allocator``)."""

from __future__ import annotations

import torch

from harness.runner.measure.trace import _order_by_total


def _all_threads_flag():
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` as a ctypes bool, or None where libc10 does not
    export it. The profiler's memory events come only from threads the profiler runs on, and the c10
    CPU allocator's running total (``ProfiledCPUMemoryReporter`` in c10/core/CPUAllocator.cpp, torch
    2.13) counts a free only on such a thread unless this flag is set: a block made on the main thread
    and freed on a gloo worker thread (``_reduce_scatter_base_``'s input clone, a gradient held by a
    gloo work object) stayed in the total until the step ended. Which thread drops the last reference
    is a race, so measured CPU peaks were inflated on some ranks and not others (tiny, dp 2, ZeRO-3:
    23.7 MiB, or 24.4 or 27.7 MiB on one rank, run to run; with the flag set, 23.7 MiB on every rank of
    every run). PyTorch has no Python setter for c10 flags; the symbol is a plain exported ``bool``."""
    import ctypes
    import os

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib"):
        try:
            return ctypes.c_bool.in_dll(
                ctypes.CDLL(os.path.join(lib_dir, name)), "FLAGS_caffe2_report_cpu_memory_usage"
            )
        except (OSError, ValueError):
            continue
    return None


_accounting_base: int | None = None  # c10's running total when start_cpu_accounting ran, else None


def accounting_base() -> int | None:
    """c10's running total when :func:`start_cpu_accounting` ran in this process, else None."""
    return _accounting_base


def start_cpu_accounting() -> None:
    """Count every CPU allocation and free from here on, on every thread (``_all_threads_flag``), so that
    the measured step's running total is this process's live tensor memory: less the total found here
    (what a parent process left in it), it counts the blocks made before the step and freed during it,
    which a count started at the step cannot see. (DDP's reducer frees its first gradient buckets when
    it rebuilds them in the second step's forward: counted from the step alone, both sets looked alive,
    one gradient copy too many; tiny dp 2: 83.3 MB read, 76.1 MB held.) A rank calls it first."""
    global _accounting_base
    flag = _all_threads_flag()
    if flag is None:
        return
    flag.value = True
    # The total is not readable from Python; a one-byte allocation under the profiler reports it.
    with _AllocatorPeak() as probe:
        torch.empty(1, dtype=torch.uint8)
    _accounting_base = probe.start_total


def stop_cpu_accounting() -> None:
    """Stop what ``start_cpu_accounting`` started (its bookkeeping costs every allocation a lock)."""
    global _accounting_base
    flag = _all_threads_flag()
    if flag is not None:
        flag.value = False
    _accounting_base = None


class _AllocatorPeak:
    """The CPU allocator's own running total: ``torch.profiler`` with ``profile_memory=True`` records
    every allocation with the c10 allocator's running total; ``peak_bytes`` is the largest, less the
    total when the profiler started (0 if nothing was allocated). What was alive at the start must be
    added by the caller.

    The total is c10's, kept across the whole process (a rank forked from a process that profiled
    before, such as the test suite, starts with that process's leftovers: hence the subtraction) and,
    with the flag of ``_all_threads_flag`` set for the step, over every thread. The events carrying it
    are the profiler's, from its own threads only, put back in the total's order (``_order_by_total``).
    The allocator's events are not replayed (``peak.REPLAYED_TRACE`` says why)."""

    def __enter__(self) -> _AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self.peak_bytes = 0
        self._flag = _all_threads_flag()
        self._flag_was = bool(self._flag.value) if self._flag is not None else False
        if self._flag is not None:
            self._flag.value = True
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._C._profiler import _EventType

        try:
            self._prof.__exit__(*exc)
        finally:
            if self._flag is not None:
                self._flag.value = self._flag_was
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        found = []
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                f = event.extra_fields
                found.append(
                    (
                        event.start_time_ns,
                        len(found),
                        int(f.ptr),
                        int(f.alloc_size),
                        int(f.total_allocated),
                        event,
                    )
                )
        found.sort(key=lambda e: e[:2])
        _order_by_total(found)
        self.start_total = self.max_total = None
        if found:
            self.start_total = found[0][4] - found[0][3]
            self.max_total = max(self.start_total, *(e[4] for e in found))
            self.peak_bytes = max(0, self.max_total - self.start_total)
