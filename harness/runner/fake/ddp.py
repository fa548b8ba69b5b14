"""DDP's gradient buckets, accounted for explicitly in a fake run.

``DistributedDataParallel`` cannot run on fake tensors: its C++ reducer checks parameter shapes across
ranks with real collectives and hands bucket data pointers to the process group. What it holds is
simple and is reproduced here in Python, on the same parameters, with the runner's settings
(``gradient_as_bucket_view=True``, default ``bucket_cap_mb``, ``find_unused_parameters=False``):

- flat buckets, one tensor each, in the parameters' dtype, filled in reverse registration order (the
  reducer's ``_compute_bucket_assignment_by_size``); they live as long as the model. Before the
  rebuild there is one bucket per dtype, all parameters in it: without ``find_unused_parameters``
  DDP's initial size limit is ``sys.maxsize`` (torch 2.13 ``BucketCapacityConfig
  .compute_bucket_size_limits``; a real gloo run of ``small`` shows one 39,994,368 B bucket, then
  8,388,608 + 31,605,760 B after the rebuild). An emulation with 1 MiB + 25 MiB initial buckets
  replayed 4.8 % above the real run's reserved peak on ``small`` dp 2 ZeRO-1 with 3 micro-batches;
- when a gradient is ready (and gradients are being synchronised), it is copied into its bucket view
  and the parameter's ``.grad`` becomes that view (``Reducer::mark_variable_ready`` /
  ``initialize_bucket_views``); under ``no_sync`` (gradient accumulation) the gradients accumulate in
  fresh tensors beside the buckets until the synchronising micro-batch;
- the reducer rebuilds its buckets once, in the second step's first forward (``_rebuild_buckets``,
  in gradient-ready order, the first bucket cut at 1 MiB and the others at 25 MiB), releasing the
  first set: one set is alive at any peak. (The CPU study once
  measured both sets alive through that step; that was its instrument, which counted the first set's
  free only from the step's start: harness/runner/measure ``start_cpu_accounting``.)
All-reduces are in place and the fake group moves nothing, so they add no memory. Everything here is
on the default CUDA stream, as under the real reducer, which allocates its buckets on the current stream
and all-reduces them in place on NCCL's stream, allocating nothing there (harness/runner/measure, the
stream constants): a fake DDP trace has no side-stream blocks, and needs none.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)
FIRST_BUCKET_CAP_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def initial_buckets(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` per bucket before the rebuild: one bucket per dtype, in reverse order."""
    buckets: list[list[int]] = []
    for i in reversed(range(len(params))):
        if buckets and params[buckets[-1][-1]].dtype == params[i].dtype:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


class BucketedReplica(nn.Module):
    """A stand-in for ``DistributedDataParallel(module, gradient_as_bucket_view=True)`` in a fake run."""

    def __init__(self, module: nn.Module, ignored: frozenset[str] = frozenset()):
        super().__init__()
        self.module = module
        # (``ignored``: parameters DDP is told to leave alone, expert parallelism's experts)
        self._params = [q for n, q in module.named_parameters() if q.requires_grad and n not in ignored]
        self._sync = True
        self._backwards = 0  # synchronising backwards finished
        self._callback_queued = False
        self._rebuilt = False
        self._views: dict[int, torch.Tensor] = {}
        self._ready_order: list[int] = []
        self._buckets = self._allocate(initial_buckets(self._params))
        for index, q in enumerate(self._params):
            q.register_post_accumulate_grad_hook(self._make_hook(index))

    def _allocate(self, assignment: list[list[int]]) -> list[torch.Tensor]:
        buckets = []
        for indices in assignment:
            first = self._params[indices[0]]
            flat = torch.empty(sum(self._params[i].numel() for i in indices), dtype=first.dtype)
            offset = 0
            for i in indices:
                q = self._params[i]
                self._views[i] = flat[offset : offset + q.numel()].view_as(q)
                offset += q.numel()
            buckets.append(flat)
        return buckets

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync:
                return
            if not self._callback_queued:  # once per backward, run when the engine finishes
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            view = self._views[index]
            if param.grad is not None and param.grad is not view:
                view.copy_(param.grad)
                param.grad = view
            if not self._rebuilt:
                self._ready_order.append(index)

        return hook

    def _backward_done(self) -> None:
        self._callback_queued = False
        self._backwards += 1

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, *args, **kwargs):
        if self._backwards >= 1 and not self._rebuilt:
            # The reducer's one rebuild, in gradient-ready order; the first set goes with it.
            self._buckets = []
            order = self._ready_order or list(range(len(self._params)))
            self._views = {}
            self._buckets = self._allocate(_group(order, self._params))
            self._rebuilt = True
        return self.module(*args, **kwargs)


def _group(order: list[int], params: list[torch.Tensor]) -> list[list[int]]:
    """``order`` cut into buckets, one dtype each, as the reducer's rebuild cuts them: the first closed
    once it holds 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``, the reducer's ``first_bucket_bytes_cap``
    under the default ``bucket_cap_mb``), every later one once it holds 25 MiB. A real gloo run of
    ``tiny`` tp 2 × cp 2 rebuilt 1,048,576 + 2,527,744 B (the head's gradient alone first); with one
    3,576,320 B bucket the fake replay read one segment (4 %) under it."""
    out: list[list[int]] = []
    current: list[int] = []
    size, dtype = 0, None
    for i in order:
        q = params[i]
        cap = BUCKET_CAP_BYTES if out else FIRST_BUCKET_CAP_BYTES
        if current and (q.dtype != dtype or size >= cap):
            out.append(current)
            current, size = [], 0
        current.append(i)
        dtype = q.dtype
        size += q.numel() * q.element_size()
    if current:
        out.append(current)
    return out


def apply_bucketed_replica(
    model: nn.Module, mesh, *, tensor_parallel: bool, ignore_experts: bool = False, ignore_head: bool = False
) -> nn.Module:
    """:func:`harness.runner.parallel.data.apply_ddp`'s signature and parameter handling, with the
    reducer's memory reproduced by :class:`BucketedReplica`."""
    from harness.runner.parallel.data import ddp_ignored

    del mesh
    ignored = frozenset(ddp_ignored(model, ignore_experts=ignore_experts, ignore_head=ignore_head))
    if tensor_parallel:
        # The real path's own transform (torch's ``_pre_dp_module_transform`` unties a tied head from
        # its embedding: traced, the head's gradient met a local bucket view as a DTensor, issue 30).
        from harness.runner.parallel.tensor import localize_for_ddp

        localize_for_ddp(model)
    return BucketedReplica(model, ignored)
