"""Expert parallelism (issue 27): each group of ``parallel.ep`` consecutive ranks of the flattened
dp·cp group holds 1/ep of every MoE block's experts and exchanges routed rows with an all-to-all, as
torchtitan (``ExpertParallel``, its ``dp_shard_in_ep × cp`` mesh dimension) and Megatron do.

Ranks of one ep group hold different experts and see different tokens; ranks at the same place of
different ep groups (the "expert data-parallel" group, dp·cp/ep ranks) hold the same experts. So the
experts' gradients are reduced over that smaller group, while every other parameter is reduced over
dp·cp as before. An expert's gradient after backward is already the sum over its ep group's tokens (the
all-to-all's backward brings every source's rows back), so it is divided by dp·cp, not by the group's
size, to be the same mean over the global batch as every other gradient (torchtitan sets FSDP2's
gradient divide factor the same way).

The dispatch itself is in :class:`harness.runner.moe.MoE`; this module makes the meshes, keeps each
rank's experts, and gives each layer the token positions of every rank of its ep group, from which the
rows each rank sends and receives follow without a host sync (the routing is a function of position).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from harness.spec.routing import local_position_list


def expert_meshes(dp_cp: DeviceMesh | None, ep: int) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the ep group's mesh, the expert data-parallel mesh) of this rank: dp·cp unflattened into
    (dp·cp/ep, ep), the ep ranks innermost (consecutive). Without expert parallelism (None, dp_cp)."""
    if ep == 1 or dp_cp is None:
        return None, dp_cp
    # The mesh's rank tensor is a real one: a fake run (FakeTensorMode) would refuse to slice it.
    with unset_fake_temporarily():
        both = dp_cp._unflatten(0, (dp_cp.size() // ep, ep), ("edp", "ep"))
    return both["ep"], both["edp"]


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [block.moe for block in model.layers.values() if block.mlp_name == "moe"]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The scale the training loop gives the loss, for every MoE block's load-balancing loss
    (harness/runner/moe.py ``_LoadBalancingLoss``)."""
    for moe in moe_blocks(model):
        moe.aux_loss_scale = scale


def apply_ep(
    model: nn.Module, ep_mesh: DeviceMesh, dp_cp: DeviceMesh, *, seq_len: int, cp: int, load_balance: bool
) -> None:
    """Keep this rank's share of every MoE block's experts and give each block its ep group and the
    token positions of each member (dp·cp index = dp rank · cp + cp rank, the flattened mesh's order)."""
    ep, mine = ep_mesh.size(), ep_mesh.get_local_rank()
    first = dp_cp.get_local_rank() - mine  # the dp·cp index of this ep group's first rank
    sources = []
    for j in range(ep):
        cp_rank = (first + j) % cp
        sources.append(
            local_position_list(seq_len, rank=cp_rank, cp=cp, load_balance=load_balance)
            if cp > 1
            else list(range(seq_len))
        )
    for moe in moe_blocks(model):
        moe.shard_experts(ep_mesh.get_group(), rank=mine, size=ep, sources=sources)


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert this rank holds (their gradients are reduced apart)."""
    return [(n, q) for n, q in model.named_parameters() if ".moe.experts." in f".{n}"]


@torch.no_grad()
def sync_expert_grads(modules: list[nn.Module], edp_mesh: DeviceMesh | None, *, shards: int) -> None:
    """Under DDP (ZeRO-0 without a pipeline, which ignores the experts' parameters): sum the experts'
    gradients over the expert data-parallel group and divide them by dp·cp (``shards``). Written here
    because DDP reduces over one group; torchtitan has no DDP path for expert parallelism."""
    for mod in modules:
        for _, param in expert_parameters(mod):
            if param.grad is None:
                continue
            if edp_mesh is not None and edp_mesh.size() > 1:
                dist.all_reduce(param.grad, group=edp_mesh.get_group())
            param.grad.div_(shards)
