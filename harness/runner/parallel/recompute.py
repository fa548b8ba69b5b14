"""Activation recomputation: none, selective (the attention core), full (every transformer block)."""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint


def apply_recompute(model: nn.Module, *, mode: str) -> None:
    """Full: wrap each block (torchtitan's choice, before FSDP). Selective: recompute only the attention
    core in backward (Korthikanti et al. 2022's selective recomputation)."""
    if mode == "full":
        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    elif mode == "selective":
        for block in model.layers.values():
            core = block.attention.core
            block.attention.core = functools.partial(checkpoint, core, use_reentrant=False)
