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
from collections.abc import Callable, Iterator
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
    import weakref
    from functools import partial

    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        MemTracker,
        _MemRefType,
        _ModMemStats,
        _UpdateType,
        _WeakRefInfo,
    )
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    _WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
    _SCALARS = (int, float, bool)

    class Tracker(MemTracker):
        # The storages it sees made and freed, as trace events (harness.alloc's format), where no
        # allocator reports them (fake tensors allocate nothing): set to a list to record. A storage's
        # address is its ``_WeakRefInfo``'s id (unique while it lives); FSDP2's ``resize_`` of an
        # unsharded parameter is a free and an allocation. ``stream_log``, where an allocator reports
        # them (a real CPU run): (address, bytes, stream) of each storage an operator makes, in order,
        # for ``_AllocatorPeak`` to give its allocations their streams. ``streams``: the stream
        # allocated on now (``_SimulatedStreams``; the stream constants above).
        trace_events: list[dict[str, Any]] | None = None
        stream_log: list[tuple[int, int, int]] | None = None
        streams: Callable[[], int] = staticmethod(lambda: DEFAULT_STREAM)
        _block_streams: dict[int, int]  # address → stream of a recorded block not on stream 0
        _grown: list[_WeakRefInfo] | None = None  # storages made or grown by the current operator

        def start_trace(self, streams: Callable[[], int] | None = None) -> None:
            """Record from here on, starting with every storage tracked now, as allocations."""
            if streams is not None:
                self.streams = streams
            self._block_streams = {}
            self.trace_events = [
                _trace_event("alloc", id(w), w.mem_consumed, DEFAULT_STREAM)
                for w, _ in self._WINFO.values()
                if w.mem_consumed
            ]

        def start_stream_log(self, streams: Callable[[], int]) -> None:
            """Log the streams of the storages operators make from here on (``stream_log``)."""
            self.streams = streams
            self.stream_log = []

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            if self._grown is not None and (
                u_type == _UpdateType.ADD or (u_type == _UpdateType.SIZE and winfo.mem_consumed)
            ):
                self._grown.append(winfo)
            events = self.trace_events
            if events is None:
                return
            addr, streams = id(winfo), self._block_streams
            if u_type == _UpdateType.DEL or (u_type == _UpdateType.SIZE and old_mem_consumed):
                size = winfo.mem_consumed if u_type == _UpdateType.DEL else old_mem_consumed
                events.append(_trace_event("free_completed", addr, size, streams.pop(addr, DEFAULT_STREAM)))
            if u_type == _UpdateType.ADD or (u_type == _UpdateType.SIZE and winfo.mem_consumed):
                stream = self.streams()
                if stream != DEFAULT_STREAM:
                    streams[addr] = stream
                events.append(_trace_event("alloc", addr, winfo.mem_consumed, stream))

        def _log_streams(self, func, res: Any) -> None:
            # The storages of this operator's result that it made (``_grown``), with the current
            # stream, for a real run's trace (whose events come from the profiler, by address). An
            # operator whose result aliases an input (a view, an ``out=``) made nothing, though the
            # tracker may see the storage as new: MemTracker knows a storage by its Python object, and
            # one that died and was made again is added again (a real gloo reduce-scatter's ``split``
            # of its input, on the reduce-scatter stream: logged, that block's address took stream 2
            # for the next allocation there).
            grown, self._grown = self._grown, None
            if not grown or _aliases(func):
                return
            stream = self.streams()
            tensors = res if type(res) in (tuple, list) else [res]
            for x in tensors:
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    w = self._WINFO.get(st)
                    if w is not None and any(w[0] is g for g in grown):
                        self.stream_log.append((st.data_ptr(), st.nbytes(), stream))

        # Only the global figures are read (``get_tracker_snapshot``: current and peak, by category),
        # never the per-module statistics (``memory_tracking``'s snapshots and local peaks), which
        # MemTracker keeps up after every operator: ``_update_peak_stats`` walks every module called so
        # far and deep-copies a snapshot for each active one whose local peak rises, and each module
        # hook deep-copies the whole snapshot: 2.4 of 18.4 profiled CPU s of a fake trace (Llama-3-70B
        # cut to 16 layers, tp 8 × pp 8, rank 0), mostly a weak-reference lookup per module per
        # operator. The overrides below keep exactly what the global figures depend on and drop the
        # rest; tests/test_measure.py compares them with MemTracker's own.

        def _update_peak_stats(self, peak_state):
            # MemTracker's global part, unchanged: a device's peak snapshot is taken where its total
            # rises (a shallow copy: its values are ints, its keys enum members and "Total").
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)

        def _pre_fw_hook(self, module, inputs):
            # What MemTracker's hook does that the global figures see: a module's first forward tracks
            # its parameters, buffers and gradients (and hooks its parameters' gradients), and a
            # forward during backward (recomputation) makes what it creates activations until the
            # outermost recomputed module's forward ends. Its snapshots and input sizes are not kept.
            # A root module's statistics are dropped before its next forward (see the class
            # docstring), so its parameters are tracked again then, as MemTracker's own hook would.
            tracking = self.memory_tracking
            is_bw = self._mod_tracker.is_bw
            if module in tracking and not is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del tracking[module]
            if module not in tracking:
                name = self._mod_tracker.get_known_fqn(module)
                if name is None:
                    raise AssertionError
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                tracking[module] = _ModMemStats(name)
            elif is_bw and self._ac_mod is None:
                self._ac_mod = weakref.ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module, inputs, outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module, args):
            pass  # per-module snapshots only

        def _post_bw_hook(self, module, args):
            pass  # per-module snapshots only

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # MemTracker's, with its ``tree_map_only`` over the result walked directly where the result
            # is a tensor or a flat tuple or list (almost every operator), in the same order.
            if any(t == DTensor for t in types):
                return NotImplemented
            waited = func is _WAIT_TENSOR and active_fake_mode()  # (MemTracker's meta wait_tensor fix)
            res = args[0] if waited else func(*args, **kwargs or {})
            if active_fake_mode() is self._fake_mode_on_entry:
                if self.stream_log is not None:
                    self._grown = []
                if self._in_opt:
                    reftype = _MemRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    reftype = _MemRefType.TEMP
                else:
                    reftype = _MemRefType.ACT
                if isinstance(res, torch.Tensor):
                    self._track(reftype, res)
                elif type(res) in (tuple, list) and all(
                    x is None or type(x) in _SCALARS or isinstance(x, torch.Tensor) for x in res
                ):
                    for x in res:
                        if isinstance(x, torch.Tensor):
                            self._track(reftype, x)
                else:
                    tree_map_only(torch.Tensor, partial(self._track, reftype), res)
                if self._grown is not None:
                    self._log_streams(func, res)
                self._update_peak_stats(None)
            return res

    return Tracker


_ALIASES: dict[Any, bool] = {}


def _aliases(func) -> bool:
    """Whether any result of the operator ``func`` aliases an input (its schema says so)."""
    known = _ALIASES.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _ALIASES[func] = schema is not None and any(r.alias_info is not None for r in schema.returns)
    return known


def _optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose ``state`` holds this rank's optimizer tensors. MemTracker counts a tensor
    made before tracking starts only if it is registered; ``ZeroRedundancyOptimizer`` keeps its
    shard's state in a local optimizer (``.optim``) and its own ``state`` stays empty, so without this
    the ZeRO-1 state was missing from every measured peak (the allocator check showed -18.6 %)."""
    local = getattr(optimizer, "optim", None)
    return [optimizer, local] if isinstance(local, torch.optim.Optimizer) else [optimizer]


def _live_device_tensors(device: torch.device, *, fake: bool) -> Iterator[torch.Tensor]:
    """One tensor per live storage on ``device`` that Python can reach (DTensors by their local shard),
    found through the garbage collector, in its order (roughly creation order). ``fake``: the fake
    tensors only (a fake run: they stand for the real rank's storages, such as pipeline buffers made in
    the warm-up step), else the real ones only — a rank forked from a process that traced a fake run
    (the test suite does) inherits its fake tensors, which hold no memory here."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen = set()
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # (isinstance would wake deprecated module proxies)
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if not (isinstance(t, FakeTensor) if fake else type(t) in (torch.Tensor, nn.Parameter)):
            continue
        if t.device != device or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st._cdata in seen:
            continue
        seen.add(st._cdata)  # (not data_ptr: every fake storage has none)
        yield t


def _untracked_live_tensors(tracker: Any, device: torch.device, *, fake: bool) -> list[torch.Tensor]:
    """The live storages' tensors on ``device`` that ``tracker`` does not know yet: what an
    allocator-level count would include."""
    known = tracker._WINFO
    return [t for t in _live_device_tensors(device, fake=fake) if t.untyped_storage() not in known]


# The CUDA stream each traced allocation would be made on. The caching allocator keeps cached blocks per
# (stream, pool) and never hands one stream's free block to another (harness/alloc.py), so where an
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
# on stream 0, as CUDA's own trace of a DDP step shows. Not modelled: the CPU-only blocks of gloo (its
# copies of collective inputs, on threads the tracker does not see) stay on stream 0.
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


# Synthetic addresses for blocks the c10 total shows but no profiler event names (made on a thread the
# profiler does not run on, such as gloo's): far above any real address, so never confused with one.
_FOREIGN_BASE = 1 << 62


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
        running = found[0][4] - found[0][3] if found else 0
        for i, (t_ns, _, ptr, size, total, _event) in enumerate(found):
            gap = (total - size) - running
            running = total
            if gap > 0:  # allocated on a thread the profiler does not see
                addr = _FOREIGN_BASE + self.foreign_allocs
                self.foreign_allocs += 1
                sizes[addr] = (gap, 0, False, len(self.events))
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
                    wrong = [g for g in guesses.get(old, []) if g[1] != ptr and g[0] > old_made]
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
                self.events.append(_trace_event("alloc", ptr, size, stream, t_ns))
            elif late.get(ptr):
                late[ptr] -= 1
            elif ptr in sizes:
                size, stream, _, _ = sizes.pop(ptr)
                self.events.append(_trace_event("free_completed", ptr, size, stream, t_ns))
            else:  # a block made before the step (``step_trace`` knows those) or before counting began
                self.events.append(_trace_event("free_completed", ptr, -size, 0, t_ns))


class _StreamMatcher:
    """Called with a profiled allocation's (address, bytes), its stream: that of the storage the tracker
    saw an operator make at that address with that size (``Tracker.stream_log``), taken in order.
    The profiler sees more allocations than the tracker (those no operator returns), so an allocation
    is matched to the first of the next few storages logged at its address that has its size, and the
    ones logged before it there are dropped (made where the profiler does not look); an allocation none
    matches is on stream 0."""

    _LOOKAHEAD = 4

    def __init__(self, log: list[tuple[int, int, int]]):
        self._at: dict[int, list[tuple[int, int]]] = {}  # address → (bytes, stream), latest last
        for addr, size, stream in reversed(log):
            self._at.setdefault(addr, []).append((size, stream))

    def __call__(self, addr: int, size: int) -> int:
        queue = self._at.get(addr)
        if queue:
            for k in range(1, min(len(queue), self._LOOKAHEAD) + 1):
                if queue[-k][0] == size:
                    stream = queue[-k][1]
                    del queue[-k:]
                    return stream
        return DEFAULT_STREAM


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


def live_storages(device: torch.device) -> list[tuple[int, int]]:
    """(address, bytes) of every tensor storage alive on ``device`` that Python can reach."""
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for t in _live_device_tensors(device, fake=False)
    ]


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
            if _accounting_base is not None and allocator.max_total is not None:
                total = allocator.max_total - _accounting_base
                held_elsewhere = allocator.start_total - _accounting_base - sum(n for _, n in start_live)
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


def step_trace(
    start_live: list[tuple[int, int]], events: list[dict[str, Any]], *, held_elsewhere: int = 0
) -> list[dict[str, Any]]:
    """The measured step as one trace: what was alive at its start first, as allocations (with
    ``held_elsewhere`` bytes that no Python object reaches as one more block), then the step's own
    events. A start block's free is its own event where the allocator counted it (it was made after
    ``start_cpu_accounting``); otherwise an address allocated again proves the block was freed, and its
    free is inserted there. Frees of blocks neither made in the step nor alive at its start are dropped."""
    out = [_trace_event("alloc", ptr, size, 0) for ptr, size in start_live]
    if held_elsewhere > 0:
        out.append(_trace_event("alloc", _HELD_ELSEWHERE, held_elsewhere, 0))
    before = {ptr: size for ptr, size in start_live}
    made: set[int] = set()
    for ev in events:
        addr = ev["addr"]
        if ev["action"] == "alloc":
            if addr in before:
                out.append(_trace_event("free_completed", addr, before.pop(addr), 0, ev["time_us"] * 1000))
            made.add(addr)
            out.append(ev)
        elif addr in made:
            made.discard(addr)
            out.append(ev)
        elif addr in before:
            out.append(_trace_event("free_completed", addr, before.pop(addr), 0, ev["time_us"] * 1000))
    return out


# The start block standing for storage that C++ objects alone hold when the step begins.
_HELD_ELSEWHERE = _FOREIGN_BASE - 2**32


def simulated(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's trace replayed through the CUDA caching-allocator model (harness/alloc.py): the
    reserved peak a GPU would show and its fragmentation, no capacity (out of memory is judged later)."""
    from harness.alloc import replay

    r = replay(events)
    return {
        "sim_peak_allocated_bytes": r.peak_allocated_bytes,
        "sim_peak_reserved_bytes": r.peak_reserved_bytes,
        "sim_fragmentation_bytes": r.fragmentation_bytes,
        "trace_events": r.num_events,
    }


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
