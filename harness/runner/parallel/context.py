"""Context parallelism: each rank holds a slice of the sequence; attention all-gathers K and V.

torch's ``context_parallel`` has no CPU path in 2.13 (no sharding rule for the CPU flash-attention op),
so this is written here, as Llama 3 does it (Llama Team 2024, §3.3.2): K and V are all-gathered with an
autograd-aware collective whose backward is a reduce-scatter, and the causal mask is built on global
token positions. With load balancing the sequence is cut into 2·cp chunks and rank r holds chunks r and
2·cp − 1 − r (head–tail), so every rank does the same attention work.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from harness.runner.model import sdpa
from harness.spec.routing import local_position_list


def local_positions(seq_len: int, *, rank: int, cp: int, load_balance: bool) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` of ``cp`` holds, in the order it holds them."""
    return torch.tensor(local_position_list(seq_len, rank=rank, cp=cp, load_balance=load_balance))


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The tokens (dim 1) of ``x`` at ``positions``."""
    return x.index_select(1, positions)


class AllGatherKVAttention:
    """A causal attention core over K and V gathered from every context-parallel rank, on SDPA's
    ``kernel`` (the model's ``train.attention``)."""

    def __init__(
        self, cp_mesh: DeviceMesh, positions: torch.Tensor, all_positions: torch.Tensor, *, kernel: str
    ):
        self.cp_mesh = cp_mesh
        self.kernel = kernel
        # mask[i, j]: local query i may attend to gathered key j. Made on the CPU here (the model may
        # still be on the meta device), moved once to the device the queries are on.
        self._mask = positions[:, None] >= all_positions[None, :]

    def mask(self, device: torch.device) -> torch.Tensor:
        if self._mask.device != device:
            self._mask = self._mask.to(device)
        return self._mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.cp_mesh)
        v_all = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.cp_mesh)
        return sdpa(q, k_all, v_all, kernel=self.kernel, attn_mask=self.mask(q.device))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, seq_len: int, load_balance: bool) -> torch.Tensor:
    """Swap every attention's core and rotary rows for this rank's slice; return its token positions."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    mine = local_positions(seq_len, rank=rank, cp=cp, load_balance=load_balance)
    everyone = torch.cat(
        [local_positions(seq_len, rank=r, cp=cp, load_balance=load_balance) for r in range(cp)]
    )
    blocks = list(model.layers.values())
    # One core (one mask) shared by every layer; the layers share one kernel.
    core = AllGatherKVAttention(cp_mesh, mine, everyone, kernel=blocks[0].attention.kernel)
    for block in blocks:
        if block.mlp_name == "moe":  # the routing follows each token's global position
            block.moe.positions = local_position_list(seq_len, rank=rank, cp=cp, load_balance=load_balance)
        attn = block.attention
        attn.positions = mine  # (CPU indices; the rows are made on the buffers' device)
        attn.reset_rope()
        attn.core = core
    return mine
