"""The CPU allocator's own accounting: c10's running total over a step, on every thread, read through
``torch.profiler`` (``memory_method=cpu_allocator``), and its allocations and frees as trace events."""

from __future__ import annotations

from typing import Any

import torch

from harness.runner.measure.trace import _FOREIGN_BASE, _order_by_total, _StreamMatcher, _trace_event


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
    added by the caller. ``events``: the same allocations and frees in time order as trace events
    (``harness.alloc``'s format).

    The total is c10's, kept across the whole process (a rank forked from a process that profiled
    before, such as the test suite, starts with that process's leftovers: hence the subtraction) and,
    with the flag of ``_all_threads_flag`` set for the step, over every thread. The events are the
    profiler's, from its own threads only. Where the two disagree, the total is the truth: a drop that
    no event explains is a free on another thread (of the oldest live blocks whose own free never shows
    and that add up to it; ``unexplained_bytes`` counts what none match), a rise is an allocation on
    another thread (a block at a synthetic address). A block made before the step is freed by its own
    event where ``start_cpu_accounting`` ran before it was made, else when its address is handed out
    again (``step_trace``)."""

    # The tracker's ``stream_log`` (filled during the step) where PeakMemory gives it: the allocations'
    # streams (``_StreamMatcher``); without it every allocation is on stream 0.
    stream_log: list[tuple[int, int, int]] = ()

    def __enter__(self) -> _AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self.peak_bytes = 0
        self.events: list[dict[str, Any]] = []
        self.inferred_frees = 0
        self.foreign_allocs = 0
        self.unexplained_bytes = 0
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
        self._to_events(found)

    def _to_events(self, found: list[tuple]) -> None:
        # Whether each allocation's free is an event of its own (before its address is handed out
        # again): a block whose free never shows was freed on another thread, and only such blocks can
        # explain a drop of the total that no event shows.
        shown = [False] * len(found)
        open_at: dict[int, int] = {}
        for i, (_, _, ptr, size, _, _) in enumerate(found):
            if size > 0:
                open_at[ptr] = i
            elif ptr in open_at:
                shown[open_at.pop(ptr)] = True
        stream_of = _StreamMatcher(self.stream_log)
        # live block → (bytes, stream, free shown, index of its alloc event), oldest first
        sizes: dict[int, tuple[int, int, bool, int]] = {}
        guesses: dict[int, list[tuple[int, int, int, int]]] = {}  # bytes → (event index, addr, stream, made)
        late: dict[int, int] = {}  # frees still to come for blocks whose free was inferred
        last_alloc: dict[int, int] = {}  # address → index of the last alloc event made there
        running = found[0][4] - found[0][3] if found else 0
        for i, (t_ns, _, ptr, size, total, _event) in enumerate(found):
            gap = (total - size) - running
            running = total
            if gap > 0:  # allocated on a thread the profiler does not see
                addr = _FOREIGN_BASE + self.foreign_allocs
                self.foreign_allocs += 1
                sizes[addr] = (gap, 0, False, len(self.events))
                last_alloc[addr] = len(self.events)
                self.events.append(_trace_event("alloc", addr, gap, 0, t_ns))
            elif gap < 0:  # freed on such a thread: which block of that size is a guess (the oldest,
                # as asynchronous collectives finish in order), unless this event reuses its address
                fits = [a for a, (n, _, seen, _) in sizes.items() if n == -gap and not seen]
                if fits:
                    chosen = [ptr if size > 0 and ptr in fits else fits[0]]
                else:  # several frees between two events: the oldest such blocks that add up to it
                    chosen, left = [], -gap
                    for a, (n, _, seen, _) in sizes.items():
                        if not seen and n <= left:
                            chosen.append(a)
                            left -= n
                    if left:
                        chosen = []
                        self.unexplained_bytes += -gap
                for addr in chosen:
                    n, stream, _, made = sizes.pop(addr)
                    guesses.setdefault(n, []).append((len(self.events), addr, stream, made))
                    self.events.append(_trace_event("free_completed", addr, n, stream, t_ns))
                    self.inferred_frees += 1
            if size > 0:
                if ptr in sizes:
                    # An address handed out again proves the block was freed, though no free was seen.
                    old, old_stream, _, old_made = sizes.pop(ptr)
                    # (a guess made after this block was allocated: its free could have been this one)
                    # — unless that other block's address was handed out again after the guessed free:
                    # alive again, it would then be allocated twice (issue 30: a BF16 run with
                    # recomputation had no replay, "alloc at ..., which is already allocated").
                    wrong = [
                        g
                        for g in guesses.get(old, [])
                        if g[1] != ptr and g[0] > old_made and last_alloc.get(g[1], -1) < g[0]
                    ]
                    if gap == 0 and wrong:
                        # The total already counted that free, against another block of the same size:
                        # the earlier guess was this block, and the other one is alive after all.
                        idx, other, other_stream, other_made = wrong[0]
                        guesses[old].remove(wrong[0])
                        self.events[idx].update(addr=ptr, stream=old_stream)
                        sizes[other] = (old, other_stream, False, other_made)
                    else:
                        self.events.append(_trace_event("free_completed", ptr, old, old_stream, t_ns))
                        self.inferred_frees += 1
                        late[ptr] = late.get(ptr, 0) + 1
                stream = stream_of(ptr, size)
                sizes[ptr] = (size, stream, shown[i], len(self.events))
                last_alloc[ptr] = len(self.events)
                self.events.append(_trace_event("alloc", ptr, size, stream, t_ns))
            elif late.get(ptr):
                late[ptr] -= 1
            elif ptr in sizes:
                size, stream, _, _ = sizes.pop(ptr)
                self.events.append(_trace_event("free_completed", ptr, size, stream, t_ns))
            else:  # a block made before the step (``step_trace`` knows those) or before counting began
                self.events.append(_trace_event("free_completed", ptr, -size, 0, t_ns))
