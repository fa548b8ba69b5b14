"""Data parallelism over the flattened dp×cp group, ZeRO stages 0–3 on PyTorch's own implementations.

- 0: ``DistributedDataParallel`` (gradients all-reduced, everything replicated); under pipeline
  parallelism, whose schedules run several forwards before a backward and break DDP's reducer
  ("rebuilt parameter indices size is not same as original model parameters size"), PyTorch's
  composable ``replicate`` (the same replication built on FSDP2's machinery, which
  ``torch.distributed.pipelining`` supports);
- 1: the same + ``ZeroRedundancyOptimizer`` (optimizer state sharded);
- 2: FSDP2 ``fully_shard(reshard_after_forward=False)`` (parameters stay unsharded until backward);
- 3: FSDP2 ``fully_shard(reshard_after_forward=True)``; with ``parallel.fsdp_reshard_after_forward=default``
  (torchtitan's) the final norm and head are a unit of their own kept unsharded after forward.
Context-parallel ranks hold the same parameters and different tokens, so they reduce gradients with the
data-parallel ranks (Megatron does the same).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype,
    keep_head: bool = False,
    chunked_loss: bool = False,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 per transformer block, then the root (embedding, norm, head), in place.

    ``keep_head`` (``parallel.fsdp_reshard_after_forward=default`` at ZeRO-3, torchtitan's wrapping:
    ``torchtitan/distributed/fsdp.py``): the final norm and the head are one unit of their own that is
    not resharded after forward, FSDP2 prefetching it straight back for backward (with tied embeddings
    the embedding joins that unit, as torchtitan does); the root then holds the embedding alone.

    ``chunked_loss`` (``train.loss_chunks`` > 1, parallel/loss.py): the head is a unit of its own, which
    the loss gathers once and keeps through its slices, as torchtitan's; resharded after forward as
    the blocks are unless ``keep_head``. Alone, not with the norm: the loss calls the head outside the
    model's forward, and a unit of several modules completes its forward only when all of them ran."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        if experts_mesh is not None:
            _shard_experts(block, fully_shard, experts_mesh, mesh.size(), mp, reshard_after_forward)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    if (keep_head or chunked_loss) and model.output is not None:
        head = [model.output] if chunked_loss else [m for m in (model.norm, model.output) if m is not None]
        if model.tok_embeddings is not None and model.output.weight is model.tok_embeddings.weight:
            head.insert(0, model.tok_embeddings)
        kept = keep_head or not reshard_after_forward
        fully_shard(head, mesh=mesh, reshard_after_forward=not kept, mp_policy=mp)
    # The root with an explicit reshard_after_forward=True is resharded after forward and gathered again
    # for backward (torch 2.13 keeps a root unsharded only when the setting is left to FSDP2:
    # _fsdp_state.py FSDPState._lazy_init, ``_auto_reshard_after_forward``): two root all-gathers a step.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def _shard_experts(block, wrap, mesh: DeviceMesh, shards: int, mp, reshard_after_forward=None) -> None:
    """Expert parallelism: a block's experts as one unit of their own over the expert data-parallel
    ``mesh`` (the ranks holding the same experts), their gradients divided by dp·cp (``shards``), not
    by that mesh's size (parallel/expert.py; torchtitan's ``set_gradient_divide_factor``)."""
    if block.mlp_name != "moe":
        return
    kw = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    unit = wrap(block.moe.experts, mesh=mesh, mp_policy=mp, **kw)
    unit.set_gradient_divide_factor(float(shards))
    # A divisor other than the group's size is NCCL's PREMUL_SUM, which gloo lacks: on the CPU a sum
    # and an in-place division after it (the same memory). Not on a mesh of one rank, which reduces
    # nothing: torch 2.13 divides there by the factor and, when sums are forced, by it again
    # (_fsdp_collectives.foreach_reduce; found by loss equality, ep = dp·cp).
    unit.set_force_sum_reduction_for_comms(mesh.device_type == "cpu" and mesh.size() > 1)


def apply_replicate(
    model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype, experts_mesh: DeviceMesh | None = None
) -> None:
    """ZeRO-0 for pipeline stages: per-block and root ``replicate`` (gradients all-reduced), in place."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        if experts_mesh is not None:
            _shard_experts(block, replicate, experts_mesh, mesh.size(), mp)
        replicate(block, mesh=mesh, mp_policy=mp)
    replicate(model, mesh=mesh, mp_policy=mp)


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    tensor_parallel: bool,
    ignore_experts: bool = False,
    ignore_head: bool = False,
) -> nn.Module:
    """DDP over ``mesh``'s group; with tensor parallelism, DTensor parameters are first exposed as local
    tensors (``localize_for_ddp``: PyTorch's recipe for DDP + TP, keeping tied embeddings tied).

    Buffers are not synchronised: the only ones are the rotary tables, which context parallelism makes
    different on every cp rank (each holds its own token positions); DDP would overwrite them with rank
    0's, at construction and before every forward.
    """
    if tensor_parallel:
        from harness.runner.parallel.tensor import localize_for_ddp

        localize_for_ddp(model)
    ignored = [name for name, _ in model.named_buffers()]
    ignored += ddp_ignored(model, ignore_experts=ignore_experts, ignore_head=ignore_head)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(
        model, process_group=mesh.get_group(), gradient_as_bucket_view=True, broadcast_buffers=False
    )


def ddp_ignored(model: nn.Module, *, ignore_experts: bool, ignore_head: bool) -> list[str]:
    """The parameters DDP leaves alone, each reduced by hand instead (compose.train_step): expert
    parallelism's experts (over their own group), and under the chunked loss the head, whose gradient
    each slice's backward makes again while DDP's reducer takes a parameter once per backward (with
    tied embeddings the embedding's too: one parameter)."""
    out = []
    if ignore_experts:
        from harness.runner.parallel.expert import expert_parameters

        out += [name for name, _ in expert_parameters(model)]
    if ignore_head:
        out += [n for n, q in model.named_parameters(remove_duplicate=False) if q is model.output.weight]
    return out


def make_optimizer(
    params: list[nn.Parameter], *, zero_stage: int, mesh: DeviceMesh | None, lr: float, eps: float
) -> torch.optim.Optimizer:
    """AdamW with the ``foreach`` implementation; ZeRO-1 shards it over ``mesh``'s group."""
    if zero_stage == 1 and mesh is not None:
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=torch.optim.AdamW,
            process_group=mesh.get_group(),
            lr=lr,
            eps=eps,
            foreach=True,
        )
    return torch.optim.AdamW(params, lr=lr, eps=eps, foreach=True)
