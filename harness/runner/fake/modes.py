"""The context managers a fake trace runs under: real meshes, private sharding propagation, DDP replaced
by explicit buckets, pipeline stages' meta shapes, and a deepcopy that stays fake."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from harness.spec import RunSpec


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """DeviceMesh concatenation (FSDP2 over a dp × tp mesh) with fake mode suspended: it builds its
    index tensor from real values, which FakeTensorMode refuses (../shared/research/torch-cpu.md 6.3)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return original(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)


@contextlib.contextmanager
def _private_sharding_propagation() -> Iterator[None]:
    """DTensor's output-metadata propagation in a fake mode of its own, as in a real run.

    For ops without a cached rule DTensor runs the op on global-shape fake tensors
    (``ShardingPropagator._propagate_tensor_meta_non_cached``) in ``detect_fake_mode() or
    FakeTensorMode()``. In a real run that is a fresh mode, which MemTracker recognises and skips;
    in a fake run it is the trace's own mode, so MemTracker counted those global-shape tensors as
    the rank's memory: loss_parallel's FP32 log-softmax over the whole vocabulary (tiny, tp 2, s 1024,
    BF16: traced 73.7 MiB against 61.8 MiB measured on a real CPU run). With the trace's mode
    suspended the propagation makes its own, as it does in a real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with unset_fake_temporarily():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def _bucketed_ddp(compose) -> Iterator[None]:
    """The composer's DDP replaced by :class:`BucketedReplica` while tracing."""
    from harness.runner.fake.ddp import apply_bucketed_replica

    original = compose.apply_ddp
    compose.apply_ddp = apply_bucketed_replica
    try:
        yield
    finally:
        compose.apply_ddp = original


def hidden_meta_dtype(spec: RunSpec):
    """The dtype of the hidden states a pipeline stage sends: BF16 under FSDP2 or ``replicate``'s
    mixed precision, FP32 under autocast (the residual stream stays FP32) and in FP32 runs."""
    import torch

    p = spec.parallel
    fsdp_like = p.dp * p.cp > 1  # with pp > 1 the runner always replicates or shards (compose)
    return torch.bfloat16 if spec.train.precision == "bf16" and fsdp_like else torch.float32


@contextlib.contextmanager
def _local_stage_meta(spec: RunSpec) -> Iterator[None]:
    """Pipeline stages without the peer ranks: the schedule's warm-up vote and its metadata exchange
    go over the process group (``recv_object_list``, a value read with ``.item()``), which the fake
    group does not carry. Every stage of the runner votes the same way (none is given shapes), so each
    stage takes its own vote, and the metadata a neighbour would send — the hidden states
    (micro-batch, s / cp [/ tp under sequence parallelism], h) forward, their gradient backward —
    is built here."""
    import torch
    from torch.distributed.pipelining import _utils as pu
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    p, t = spec.parallel, spec.train
    tokens = t.seq_len // p.cp // (p.tp if p.tp > 1 and p.sequence_parallel else 1)
    shape = (t.micro_batch_size, tokens, spec.model.hidden_size)

    def recv_meta(stage, src_stage):
        hidden = torch.empty(shape, dtype=hidden_meta_dtype(spec), requires_grad=True)
        metas = pu.extract_tensor_metas((hidden,))
        if src_stage < stage.stage_index:
            return pu._StageForwardMeta(forward_metas=metas)
        return pu._StageBackwardMeta(backward_metas=stage._stage_meta.outputs or metas)

    def warmup(schedule, stages, has_backward, p2p_done):
        for stage in stages:
            dynamic = pu.InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = pu.InferenceMode.DYNAMIC if dynamic else pu.InferenceMode.STATIC

    patches = [
        (PipelineStage, "_recv_meta", recv_meta),
        (PipelineStage, "_send_meta", lambda stage, meta, dst_stage: None),
        (schedules._PipelineSchedule, "_warmup_p2p", warmup),
    ]
    originals = [(cls, name, cls.__dict__.get(name)) for cls, name, _ in patches]
    for cls, name, fn in patches:
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for cls, name, fn in originals:
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)


@contextlib.contextmanager
def _fake_deepcopy(fake_mode) -> Iterator[None]:
    """``copy.deepcopy`` of a fake model (a pipeline stage is a copy, ``pipeline.split_stage``) in the
    same fake mode: a plain deepcopy converts each fake tensor into a new mode ("Mixing fake modes"),
    and ``FakeCopyMode`` returns plain fake tensors where parameters were, which are made parameters
    again."""
    import copy

    from torch import nn
    from torch._subclasses.fake_tensor import FakeCopyMode

    from harness.runner.parallel import pipeline

    def deepcopy(obj, memo=None):
        with FakeCopyMode(fake_mode):
            out = copy.deepcopy(obj, memo)
        made: dict[int, nn.Parameter] = {}  # tied weights stay one parameter
        for mod in out.modules() if isinstance(out, nn.Module) else ():
            for name, q in list(mod._parameters.items()):
                if q is not None and not isinstance(q, nn.Parameter):
                    if id(q) not in made:
                        made[id(q)] = nn.Parameter(q, requires_grad=q.requires_grad)
                    mod._parameters[name] = made[id(q)]
        return out

    class _Copy:  # the ``copy`` module as pipeline.py sees it
        def __getattr__(self, name):
            return deepcopy if name == "deepcopy" else getattr(copy, name)

    pipeline.copy = _Copy()
    try:
        yield
    finally:
        pipeline.copy = copy


@contextlib.contextmanager
def _gloo_reduce_scatter_copy(gloo: bool) -> Iterator[None]:
    """On ``device=cpu`` (gloo): FSDP2's reduce-scatter holds a whole copy of its input for the call, as
    gloo's does — ``ProcessGroupGloo::_reduce_scatter_base`` runs ``reduce_scatter_tensor_coalesced``,
    which clones the input, all-reduces the clone and copies this rank's chunk out (torch 2.13
    ProcessGroupGloo.cpp; measured: ``aten::clone`` +16 MiB for a 16 MiB input). The fake process group
    allocates nothing, so without this a CPU trace missed the copy at the root's reduce-scatter, the
    real run's peak (issue 30: ``small``, BF16, ZeRO-3, 112.8 MiB real against 96.8 traced). NCCL makes
    no such copy (``ncclReduceScatter`` from the input's own pointer): GPU presets trace without it."""
    if not gloo:
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives.DefaultReduceScatter.__call__

    # On the stream current at the call (FSDP2's reduce-scatter stream), where a real CPU run's tracker
    # sees gloo's copy made (tiny, dp 2, ZeRO-3: the 738,304 B copy of each block's gradients and the
    # root's 4,194,816 B, on stream 2; tests/runner/test_streams.py).
    def call(self, output_tensor, input_tensor, group, op, async_op=False):
        copy = input_tensor.clone()  # gloo's working copy, alive while the collective runs
        try:
            return original(self, output_tensor, input_tensor, group, op, async_op)
        finally:
            del copy

    _fsdp_collectives.DefaultReduceScatter.__call__ = call
    try:
        yield
    finally:
        _fsdp_collectives.DefaultReduceScatter.__call__ = original


@contextlib.contextmanager
def _gloo_functional_reduce_scatter_copies(gloo: bool) -> Iterator[None]:
    """On ``device=cpu`` (gloo): DTensor's reduce-scatter (a sequence-parallel row-parallel linear's
    output, ``Shard._reduce_shard_tensor`` → ``funcol.reduce_scatter_single``) holds a copy of its
    input while the collective's output is made: ``ProcessGroupGloo::_reduce_scatter_base`` clones the
    input (as for FSDP2, ``_gloo_reduce_scatter_copy``). Where the sequence does not split evenly,
    DTensor's own padded ``cat`` is a second copy, an operator the fake run traces already. The fake
    group allocates nothing, so the fake trace read 0.9 % below the real run at tp 2 × pp 2 (tied,
    stage 0) and 1.3 % at tp 3 × pp 3 (stage 1), issue 30 item 4; with two copies here, tp 2 × pp 2
    read 0.8 % above. NCCL makes no copy: GPU presets trace without it."""
    if not gloo:
        yield
        return
    import torch.distributed._functional_collectives as funcol

    from harness.runner.measure.tracker import untraced

    original = funcol.reduce_scatter_single

    # Counted in the peak, left out of the trace: a real run's tracker never sees the copy (gloo makes
    # it inside the functional collective's C++, under the dispatch mode's own call), so the trace
    # the real run replays has no such storage, and neither does the fake one.
    def call(tensor, *args, **kwargs):
        with untraced():
            copy = tensor.clone()  # gloo's working copy, alive for the call
        try:
            return original(tensor, *args, **kwargs)
        finally:
            del copy

    funcol.reduce_scatter_single = call
    try:
        yield
    finally:
        funcol.reduce_scatter_single = original


@contextlib.contextmanager
def _collectives_waited_at_first_use(gloo: bool) -> Iterator[None]:
    """On ``device=cpu`` (gloo): functional collectives as an eager run makes them, the output waited
    where it is first used (an ``AsyncCollectiveTensor``) and the input alive until then where the
    Work holds it. Under a fake mode ``funcol`` takes the run for a compiler's trace and waits each
    output at once (``_are_we_tracing``), so the inputs were freed at the call. Measured on gloo (2
    ranks): the Work keeps the input of ``all_gather_into_tensor`` and ``all_to_all_single`` until the
    wait, not that of ``reduce_scatter_tensor`` (gloo reduces a copy,
    ``_gloo_functional_reduce_scatter_copies``) nor that of ``all_reduce`` (which reduces a clone, its
    output). tp 2 + SP, tiny BF16: the backward's sequence shards were freed at their all-gather in
    the fake trace, at its output's first use in the real one, and the fake replay read one 2 MiB
    segment (5 %) under the real one; now equal to the byte on every point of the BF16 study.

    GPU presets keep the immediate wait: NCCL's Work holds every input (reduce-scatter's too) until the
    wait, and emulated so, a Llama-3-8B tp 4 × dp 2 trace held nine backward reduce-scatter inputs
    (2.4 GB) whose waits the tracker never saw; no GPU run has checked either, so the traces of GPU
    presets stay as they were until one does."""
    if not gloo:
        yield
        return
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.compiler import is_compiling

    from harness.runner.measure.tracker import collective_inputs_held

    held = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_to_all_single"})
    original = funcol._maybe_wrap_tensor

    class Wrap(torch.autograd.Function):
        # funcol's ``_wrap_tensor_autograd``, whose own fake kernel makes a new tensor instead: the
        # wrapper in the autograd graph, the gradient passed through unchanged.
        @staticmethod
        def forward(ctx, tensor):
            return funcol.AsyncCollectiveTensor(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def wrap(tensor):
        if is_compiling():
            return original(tensor)
        if torch.is_grad_enabled() and tensor.requires_grad:
            return Wrap.apply(tensor)
        return funcol.AsyncCollectiveTensor(tensor)

    funcol._maybe_wrap_tensor = wrap
    try:
        with collective_inputs_held(held):
            yield
    finally:
        funcol._maybe_wrap_tensor = original


@contextlib.contextmanager
def _gloo_all_gather_temporaries(gloo: bool) -> Iterator[None]:
    """On ``device=cpu`` (gloo): FSDP2's all-gather allocates, inside the call, two output-sized
    temporaries one after the other, while ``foreach_all_gather`` still holds the compute-dtype casts
    of the shards (its ``all_gather_inputs`` list, freed when it returns). Seen in every all-gather of
    a real CPU trace, the root's and each block's (``tiny``, pp 2 × dp 2, ZeRO-3, BF16: two 1 MiB
    buffers allocated and freed on the default stream between the copy-in and the copy-out of the 1 MiB
    output). The fake group allocates nothing, so the CPU trace missed them, and the 0.5 MiB cast of
    the root's shard with them at stage 0's peak: 5 pp × FSDP2 points of the BF16 study traced up to
    3.1 % below their real runs. NCCL's all-gather writes the output directly: GPU presets trace
    without them."""
    if not gloo:
        yield
        return
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives.DefaultAllGather.__call__
    default = torch.cpu.current_stream()

    def call(self, output_tensor, input_tensor, group, async_op=False):
        with torch.cpu.stream(default):
            for _ in range(2):  # gloo's working buffers, one at a time
                del_me = torch.empty_like(output_tensor)
                del del_me
        return original(self, output_tensor, input_tensor, group, async_op)

    _fsdp_collectives.DefaultAllGather.__call__ = call
    try:
        yield
    finally:
        _fsdp_collectives.DefaultAllGather.__call__ = original


@functools.cache
def _held_work_class():
    """A ``dist.Work`` that keeps tensors alive as long as it lives and waits on the Work it wraps, as
    gloo's works hold theirs (``ProcessGroupGloo``'s send and receive works hold their tensor until
    destroyed). A ``dist.Work`` itself, as the schedules' callers may check. Made once: torch is
    imported only where a trace runs."""
    import torch.distributed as dist

    class HeldWork(dist.distributed_c10d.Work):
        def __init__(self, work, tensors) -> None:
            super().__init__()
            self.work, self.tensors = work, tensors

        def wait(self, *args, **kwargs):
            return self.work.wait(*args, **kwargs)

        def is_completed(self) -> bool:
            return self.work.is_completed()

    return HeldWork


def _held_work(work, tensors):
    """``work`` as one that keeps ``tensors`` alive as long as it lives (:func:`_held_work_class`)."""
    return _held_work_class()(work, tensors)


@contextlib.contextmanager
def _gloo_works_hold_tensors(gloo: bool) -> Iterator[None]:
    """On ``device=cpu`` (gloo): a point-to-point op's tensor stays allocated while its Work lives, as
    gloo's does; the fake group's works hold nothing. A pipeline's send keeps the tensor it sent while
    the schedule keeps its Work — which torch's 1F1B does across the steady state (``send_work`` of the
    first warm-up forward is replaced only after the 1B1F loop, torch 2.13
    ``Schedule1F1B._step_microbatches``) and interleaved 1F1B until the step ends
    (``pipeline.interleaved_sends_kept``). A CPU trace freed stage 0's first stage output at its
    backward, where the real run keeps it (``tiny``, pp 2, FP32: 128 KiB of 26.6 MiB below the real
    peak; interleaved, BF16, 8 micro-batches: 9 % below). NCCL's works are left as the fake group
    makes them (GPU presets)."""
    if not gloo:
        yield
        return
    from torch.distributed.pipelining import schedules

    batch_p2p = schedules._batch_p2p

    def held_batch_p2p(p2p_ops, desc=None):
        works = batch_p2p(p2p_ops, desc=desc)
        if len(works) != len(p2p_ops):  # coalesced into fewer works: each holds every tensor
            return [_held_work(w, [op.tensor for op in p2p_ops]) for w in works]
        return [_held_work(w, op.tensor) for w, op in zip(works, p2p_ops, strict=True)]

    schedules._batch_p2p = held_batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = batch_p2p
