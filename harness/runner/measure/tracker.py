"""PyTorch's MemTracker, extended: the peak by category (parameters, gradients, optimizer state,
activations, temporaries), every storage it makes logged with its simulated stream, and the live
storages it cannot see."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from harness.runner.measure.trace import DEFAULT_STREAM, _trace_event

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


# The functional collectives (``_c10d_functional`` op names) whose input a fake run keeps alive until
# their output is waited, as a real process group's Work does (``collective_inputs_held``).
_HELD_UNTIL_WAIT: list[frozenset[str]] = [frozenset()]
# Depth of ``untraced()`` blocks open now (a rank runs one tracker at a time).
_UNTRACED = [0]


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Storages made inside count in the tracker's figures (its peak) but stay out of its trace, they
    and their frees: what a fake run emulates that a real run's tracker never sees as an operator's
    storage, such as a copy a collective's C++ makes under the dispatch mode's own call, which the
    CPU allocator counts but no operator owns (``fake.modes``)."""
    _UNTRACED[0] += 1
    try:
        yield
    finally:
        _UNTRACED[0] -= 1


@contextlib.contextmanager
def collective_inputs_held(ops: frozenset[str]) -> Iterator[None]:
    """While open, a fake run's tracker keeps the input of each functional collective named in ``ops``
    alive until the collective's output (its storage, any view of it) is waited: what the real Work
    does, registered under the output (c10d ``Functional.cpp``: ``register_work``, dropped at
    ``wait_tensor``), where a fake collective holds nothing."""
    _HELD_UNTIL_WAIT[0] = ops
    try:
        yield
    finally:
        _HELD_UNTIL_WAIT[0] = frozenset()


@contextlib.contextmanager
def _input_hooks_released() -> Iterator[None]:
    """While open, the backward hooks ModTracker puts on each module's inputs are removed once they
    have fired (at the end of that backward), instead of living as long as the inputs.

    torch 2.13's ``register_multi_grad_hook`` (mode ``all``, ModTracker's ``_fw_pre_hook``) keeps the
    inputs' ``grad_fn`` nodes in the hook's closure and registers the hook on the inputs themselves.
    For an input that is a leaf and not a parameter the node is its grad accumulator, which holds the
    tensor: a cycle through C++ that Python's collector cannot see, so the tensor outlived the step
    whenever the tracker ran. Found on the chunked loss (each slice of the hidden states is such a
    leaf, a view of the whole): every micro-batch's gathered hidden states stayed allocated to the
    end of the measured step, in real CPU runs (``small``, tp 2, s 2048, 8 micro-batches: 7 × 4 MiB
    above the same step untracked) and in every fake trace, never in an untracked step. A run that a
    tracker does not watch (a user's trainer) has no such cycle."""
    from torch.autograd import Variable
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook

    def released(tensors, fn, *, mode="all"):
        if mode != "all":  # (mode "any", on a module's outputs, keeps no node in its closure)
            return register(tensors, fn, mode=mode)
        handle = None

        def once(*args):
            fn(*args)
            # removed when this backward ends, not while the engine walks the tensor's hooks
            Variable._execution_engine.queue_callback(handle.remove)

        handle = register(tensors, once, mode=mode)
        return handle

    mod_tracker.register_multi_grad_hook = released
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register


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
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        MemTracker,
        _MemRefType,
        _ModMemStats,
        _UpdateType,
    )
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten, tree_map_only

    _WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
    _SCALARS = (int, float, bool)

    class Tracker(MemTracker):
        # The storages it sees made and freed, as trace events (harness.alloc's format), where no
        # allocator reports them (fake tensors allocate nothing): set to a list to record. A storage's
        # address is its ``_WeakRefInfo``'s id (unique while it lives); FSDP2's ``resize_`` of an
        # unsharded parameter is a free and an allocation. ``streams``: the stream allocated on now
        # (``_SimulatedStreams``; the stream constants above).
        trace_events: list[dict[str, Any]] | None = None
        streams: Callable[[], int] = staticmethod(lambda: DEFAULT_STREAM)
        _block_streams: dict[int, int]  # address → stream of a recorded block not on stream 0
        _untraced: set[int]  # addresses of live storages made under ``untraced()``
        _held_inputs: dict[int, list[torch.Tensor]]  # collective output's storage → the inputs held

        def __enter__(self):
            self._released = _input_hooks_released()
            self._released.__enter__()
            try:
                return super().__enter__()
            except BaseException:
                self._released.__exit__(None, None, None)
                raise

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                self._released.__exit__(None, None, None)

        def start_trace(self, streams: Callable[[], int] | None = None) -> None:
            """Record from here on, starting with every storage tracked now, as allocations."""
            if streams is not None:
                self.streams = streams
            self._block_streams, self._untraced = {}, set()
            self.trace_events = [
                _trace_event("alloc", id(w), w.mem_consumed, DEFAULT_STREAM)
                for w, _ in self._WINFO.values()
                if w.mem_consumed
            ]

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            events = self.trace_events
            if events is None:
                return
            addr, streams = id(winfo), self._block_streams
            if _UNTRACED[0] and u_type == _UpdateType.ADD:
                self._untraced.add(addr)
            if addr in self._untraced:
                if u_type == _UpdateType.DEL:
                    self._untraced.discard(addr)
                return
            if u_type == _UpdateType.DEL or (u_type == _UpdateType.SIZE and old_mem_consumed):
                size = winfo.mem_consumed if u_type == _UpdateType.DEL else old_mem_consumed
                events.append(_trace_event("free_completed", addr, size, streams.pop(addr, DEFAULT_STREAM)))
            if u_type == _UpdateType.ADD or (u_type == _UpdateType.SIZE and winfo.mem_consumed):
                stream = self.streams()
                if stream != DEFAULT_STREAM:
                    streams[addr] = stream
                events.append(_trace_event("alloc", addr, winfo.mem_consumed, stream))

        # Only the global figures are read (``get_tracker_snapshot``: current and peak, by category),
        # never the per-module statistics (``memory_tracking``'s snapshots and local peaks), which
        # MemTracker keeps up after every operator: ``_update_peak_stats`` walks every module called so
        # far and deep-copies a snapshot for each active one whose local peak rises, and each module
        # hook deep-copies the whole snapshot: 2.4 of 18.4 profiled CPU s of a fake trace (Llama-3-70B
        # cut to 16 layers, tp 8 × pp 8, rank 0), mostly a weak-reference lookup per module per
        # operator. The overrides below keep exactly what the global figures depend on and drop the
        # rest; tests/runner/test_measure.py compares them with MemTracker's own.

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

        def _hold_inputs(self, func, args, res, waited) -> None:
            held = self.__dict__.setdefault("_held_inputs", {})
            if waited:
                held.pop(_storage_key(args[0]), None)
            elif func._opname in _HELD_UNTIL_WAIT[0] and func.namespace == "_c10d_functional":
                inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
                for out in tree_flatten(res)[0]:
                    if isinstance(out, torch.Tensor):
                        held[_storage_key(out)] = inputs

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # MemTracker's, with its ``tree_map_only`` over the result walked directly where the result
            # is a tensor or a flat tuple or list (almost every operator), in the same order.
            if any(t == DTensor for t in types):
                return NotImplemented
            if _HELD_UNTIL_WAIT[0] and AsyncCollectiveTensor in types:
                # The collective's output first used: the subclass waits it and runs the operator on
                # the plain tensor, both through this mode, which sees the wait (else it happened in
                # here with this mode off, and the held input was never let go).
                return NotImplemented
            waited = func is _WAIT_TENSOR and active_fake_mode()  # (MemTracker's meta wait_tensor fix)
            res = args[0] if waited else func(*args, **kwargs or {})
            if _HELD_UNTIL_WAIT[0]:
                self._hold_inputs(func, args, res, waited)
            if active_fake_mode() is self._fake_mode_on_entry:
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
                self._update_peak_stats(None)
            return res

    return Tracker


def _storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, the same for every view of it (fake storages have no data pointer)."""
    return t.untyped_storage()._cdata


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
