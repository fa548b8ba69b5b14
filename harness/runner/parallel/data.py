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
) -> None:
    """FSDP2 per transformer block, then the root (embedding, norm, head), in place.

    ``keep_head`` (``parallel.fsdp_reshard_after_forward=default`` at ZeRO-3, torchtitan's wrapping:
    ``torchtitan/distributed/fsdp.py``): the final norm and the head are one unit of their own that is
    not resharded after forward, FSDP2 prefetching it straight back for backward (with tied embeddings
    the embedding joins that unit, as torchtitan does); the root then holds the embedding alone."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    if keep_head and model.output is not None:
        head = [m for m in (model.norm, model.output) if m is not None]
        if model.tok_embeddings is not None and model.output.weight is model.tok_embeddings.weight:
            head.insert(0, model.tok_embeddings)
        fully_shard(head, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    # The root with an explicit reshard_after_forward=True is resharded after forward and gathered again
    # for backward (torch 2.13 keeps a root unsharded only when the setting is left to FSDP2:
    # _fsdp_state.py FSDPState._lazy_init, ``_auto_reshard_after_forward``): two root all-gathers a step.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def apply_replicate(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype) -> None:
    """ZeRO-0 for pipeline stages: per-block and root ``replicate`` (gradients all-reduced), in place."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        replicate(block, mesh=mesh, mp_policy=mp)
    replicate(model, mesh=mesh, mp_policy=mp)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, tensor_parallel: bool) -> nn.Module:
    """DDP over ``mesh``'s group; with tensor parallelism, DTensor parameters are first exposed as local
    tensors (``localize_for_ddp``: PyTorch's recipe for DDP + TP, keeping tied embeddings tied).

    Buffers are not synchronised: the only ones are the rotary tables, which context parallelism makes
    different on every cp rank (each holds its own token positions); DDP would overwrite them with rank
    0's, at construction and before every forward.
    """
    if tensor_parallel:
        from harness.runner.parallel.tensor import localize_for_ddp

        localize_for_ddp(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, _ in model.named_buffers()]
    )
    return DistributedDataParallel(
        model, process_group=mesh.get_group(), gradient_as_bucket_view=True, broadcast_buffers=False
    )


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
