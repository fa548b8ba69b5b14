"""One rank's fake trace: the real model, parallelisms and composer under ``FakeTensorMode`` and the
fake process group, a warm-up step and one measured step, MemTracker counting what the rank holds."""

from __future__ import annotations

import contextlib
from typing import Any

from harness.runner.fake.modes import (
    _bucketed_ddp,
    _collectives_waited_at_first_use,
    _fake_deepcopy,
    _gloo_all_gather_temporaries,
    _gloo_functional_reduce_scatter_copies,
    _gloo_reduce_scatter_copy,
    _gloo_works_hold_tensors,
    _local_stage_meta,
    _private_sharding_propagation,
    _real_meshes,
)
from harness.spec import RunSpec, canonical

MEMORY_METHOD = "fake"  # issue 14: "memory_method=fake" (MemTracker under FakeTensorMode counts the peak)


def gpu_kernels(spec: RunSpec) -> bool:
    """Whether the trace stands in CUDA's kernels for the CPU's (any preset but cpu)."""
    return spec.device.name != "cpu"


def card_capacity_bytes(spec: RunSpec) -> int:
    """What the caching allocator may reserve on ``spec``'s card (its memory less the estimated CUDA
    context and NCCL): the capacity each traced rank's step is replayed against."""
    from harness.estimate import estimate
    from harness.estimate.levels import allocator_capacity_bytes

    return allocator_capacity_bytes(estimate(spec))


def trace_rank(
    spec: RunSpec, rank: int, *, kernels: str | None = None, keep_trace: bool = False
) -> dict[str, Any]:
    """Peak memory of ``rank`` over one measured step after a warm-up step (:func:`warm_up`), traced in
    this process (which must hold no process group); ``kernels`` as in :func:`run_fake`. ``keep_trace``:
    the measured step's allocation trace (the events its ``sim_*`` figures replay) as ``trace``."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.runner.fake import kernels as fake_kernels
    from harness.runner.measure.peak import PeakMemory
    from harness.runner.model import Llama
    from harness.runner.parallel import compose
    from harness.runner.parallel.compose import MESH_DIMS, parallelize, train_step
    from harness.runner.worker import rank_batch

    spec = canonical(spec)
    p, t = spec.parallel, spec.train
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=p.world, store=FakeStore())
    cuda = gpu_kernels(spec) if kernels is None else kernels == "cuda"
    try:
        # Meshes are built outside FakeTensorMode (their construction reads real values).
        mesh = dist.device_mesh.init_device_mesh("cpu", (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
        if p.dp * p.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")
        cpu = torch.device("cpu")
        kernels = fake_kernels.cuda_kernels() if cuda else contextlib.nullcontext()
        with (
            FakeTensorMode() as fake_mode,
            _real_meshes(),
            _bucketed_ddp(compose),
            _local_stage_meta(spec),
            _fake_deepcopy(fake_mode),
            _private_sharding_propagation(),
            _gloo_reduce_scatter_copy(spec.device.name == "cpu"),
            _gloo_all_gather_temporaries(spec.device.name == "cpu"),
            _gloo_functional_reduce_scatter_copies(spec.device.name == "cpu"),
            _gloo_works_hold_tensors(spec.device.name == "cpu"),
            _collectives_waited_at_first_use(spec.device.name == "cpu"),
            kernels,
        ):
            model = Llama(spec.model, seq_len=t.seq_len, attention=t.attention, moe_imbalance=t.moe_imbalance)
            par = parallelize(model, spec, mesh, cpu)
            del model  # as the real rank does: a pipeline stage is a copy of it
            # As the real rank builds them (a GPU preset's are copies, as moved to the GPU)
            tokens, targets = rank_batch(spec, mesh["dp"].get_local_rank(), par.positions, cpu, copy=cuda)
            memory = PeakMemory(par.modules, par.optimizer, cpu, allocator=False)
            memory.capacity_bytes = card_capacity_bytes(spec)
            warm_up(par, tokens, targets, spec)
            with memory.measure():
                train_step(par, tokens, targets, num_microbatches=t.num_microbatches)
        out = {
            **memory.result(),
            "memory_method": MEMORY_METHOD,
            "coords": {name: mesh[name].get_local_rank() for name in MESH_DIMS},
            "kernels": "cuda" if cuda else "cpu",
        }
        if keep_trace:
            out["trace"] = memory.trace["device_traces"][0]
        partition = _zero1_partition(par.optimizer)
        if partition is not None:
            out["zero1_partition_numel"] = partition
        return out
    finally:
        dist.destroy_process_group()


def warm_up(par, tokens, targets, spec: RunSpec) -> None:
    """The step before the measured one. Without a pipeline it runs one micro-batch: what the measured
    step finds afterwards is what all of them leave (optimizer state made, DDP's buckets rebuilt at the
    next forward, FSDP2 initialised, every gradient freed by ``zero_grad``), at 1/num_microbatches of
    the cost (``test_one_micro_batch_warm_up_leaves_the_measured_step_unchanged``; scripts/
    fake_budget.py --compare showed every figure equal on six paper-scale points). A pipeline schedule
    is built for its micro-batch count and prepares its stages for it: it warms up on all of them."""
    from harness.runner.parallel.compose import train_step

    t = spec.train
    if par.schedule is None:
        b = t.micro_batch_size
        train_step(par, tokens[:b], targets[:b], num_microbatches=1)
    else:
        train_step(par, tokens, targets, num_microbatches=t.num_microbatches)


def _zero1_partition(optimizer) -> list[int] | None:
    """Parameters (elements) held by each rank's ZeroRedundancyOptimizer partition; None otherwise."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return None
    return [
        sum(q.numel() for group in groups for q in group["params"])
        for groups in optimizer._partition_parameters()
    ]
