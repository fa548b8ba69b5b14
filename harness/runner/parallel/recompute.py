"""Activation recomputation: none, selective (the attention core), op (torchtitan's op-level policy),
full (every transformer block, or every N-th).

Megatron's flags: ``full`` is ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``; ``full`` with ``every`` N stores what ``--recompute-method block
--recompute-num-layers L_stage/N`` stores (as many whole blocks checkpointed per stage, Megatron's the
first ones, torchtitan's every N-th). Megatron's ``uniform`` with N > 1 (N blocks per checkpoint) has no
counterpart here.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# torchtitan's save list for op-level selective checkpointing (torchtitan/distributed/
# activation_checkpoint.py, ``_save_list``, 2024-2025): the matmuls (every second one is recomputed,
# below), the fused attention kernels, tensor parallel's reduce-scatter (sequence parallel) and max.
# Added here: the CPU flash kernel, the counterpart on this machine of the CUDA flash kernel they list
# (without it the CPU runner would recompute attention where a GPU run keeps it). The math kernel is not
# one op (its matmuls are bmm, its softmax separate), so under ``op`` its scores are recomputed.
OP_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def op_policy():
    """torchtitan's policy for one block's forward: keep the outputs of the ops in ``OP_SAVE_LIST``
    except every second ``mm`` (counted separately in the forward and in its recomputation, so both
    make the same choice), recompute everything else."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        if func in OP_SAVE_LIST and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context():
    return create_selective_checkpoint_contexts(op_policy())


def checkpointed_layers(num_layers: int, *, every: int) -> list[int]:
    """Positions (0-based, in a stage's order) of the blocks full recomputation wraps: every ``every``-th,
    counted from 1 as torchtitan counts (``every`` 2 of 4 blocks: the 2nd and 4th)."""
    return [i for i in range(num_layers) if (i + 1) % every == 0]


def apply_recompute(model: nn.Module, *, mode: str, every: int = 1) -> None:
    """Wrap blocks before FSDP (torchtitan's order).

    - full: every ``every``-th block of this module is checkpointed whole (torchtitan's ``full``, and with
      ``every`` > 1 its layer option, counted per pipeline stage module as their per-rank counter does
      for one stage per rank);
    - op: every block under torchtitan's op-level policy (:func:`op_policy`);
    - selective: only the attention core is recomputed in backward (Korthikanti et al. 2022).
    """
    if mode == "full":
        keys = list(model.layers.keys())
        for i in checkpointed_layers(len(keys), every=every):
            model.layers[keys[i]] = checkpoint_wrapper(model.layers[keys[i]], preserve_rng_state=False)
    elif mode == "op":
        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block, context_fn=_op_context, preserve_rng_state=False)
    elif mode == "selective":
        for block in model.layers.values():
            core = block.attention.core
            block.attention.core = functools.partial(checkpoint, core, use_reentrant=False)
