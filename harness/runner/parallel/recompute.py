"""Activation recomputation: none, selective (the attention core), op (torchtitan's op-level policy),
full (every transformer block, every N-th, or Megatron's uniform and block methods).

Megatron's flags (megatron/core/transformer/transformer_block.py, ``TransformerBlock.
_checkpointed_forward``, with ``--recompute-granularity full``): ``full`` is ``--recompute-method
uniform --recompute-num-layers 1``; method ``uniform`` N runs each group of N consecutive blocks of a
chunk under one checkpoint (the group's input kept; backward recomputes the whole group at once);
method ``block`` N checkpoints the first N blocks of a chunk one by one and leaves the rest alone.
torchtitan's layer option (method ``every`` N: every N-th block) stores what ``block`` with L_chunk/N
stores, its checkpointed blocks spread out instead of first.
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
# below), the fused attention kernels, tensor parallel's reduce-scatter (sequence parallel), expert
# parallelism's all-to-all and max.
# Added here: the CPU flash kernel, the counterpart on this machine of the CUDA flash kernel they list
# (without it the CPU runner would recompute attention where a GPU run keeps it). The math kernel is not
# one op (its matmuls are bmm, its softmax separate), so under ``op`` its scores are recomputed.
# cuDNN attention (what SDPA picks first on sm90/sm100) and the overrideable fused kernel are on
# torchtitan's list too (pytorch/torchtitan b5bcd76c, ``activation_checkpoint.py``): without them an
# H100 run would recompute attention where torchtitan keeps it. A fake run's emulated CUDA kernel
# (harness/runner/fake/kernels.py) adds its own op here.
OP_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # torchtitan's, for expert parallelism's dispatch and combine (the op beneath the autograd variant
    # the layer calls: its outputs are kept, traced)
    torch.ops._c10d_functional.all_to_all_single.default,
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


def checkpoint_groups(num_layers: int, *, method: str, every: int) -> list[list[int]]:
    """Positions of the blocks each checkpoint holds, one list per checkpoint, for ``method`` with N =
    ``every`` on a chunk of ``num_layers`` blocks: every: :func:`checkpointed_layers`, one each; block:
    the first N, one each (Megatron's ``block``); uniform: consecutive groups of N (Megatron's
    ``uniform``; where N does not divide the chunk the last group is shorter — Megatron's loop would
    index past its layers there)."""
    if method == "every":
        return [[i] for i in checkpointed_layers(num_layers, every=every)]
    if method == "block":
        return [[i] for i in range(min(every, num_layers))]
    if method == "uniform":
        return [list(range(i, min(i + every, num_layers))) for i in range(0, num_layers, every)]
    raise ValueError(f"recompute method {method!r} must be one of every, uniform, block")


def apply_recompute(model: nn.Module, *, mode: str, every: int = 1, method: str = "every") -> None:
    """Wrap blocks before FSDP (torchtitan's order).

    - full: the blocks :func:`checkpoint_groups` names for ``method`` and N = ``every`` (torchtitan's
      ``full``, and with ``every`` > 1 its layer option; Megatron's ``block`` and ``uniform``), counted
      per pipeline stage module as torchtitan's per-rank counter and Megatron's per-chunk loop do. A
      checkpoint of one block wraps it (``checkpoint_wrapper``); a group of several (``uniform``) is
      named in the model's ``checkpoint_groups`` (its layer keys), which its forward loop runs under one
      ``checkpoint``: no module is renamed or moved, so FSDP2's per-block units, the pipeline split and
      tied embeddings see the same parameters;
    - op: every block under torchtitan's op-level policy (:func:`op_policy`);
    - selective: only the attention core is recomputed in backward (Korthikanti et al. 2022).
    """
    if mode == "full":
        keys = list(model.layers.keys())
        groups = checkpoint_groups(len(keys), method=method, every=every)
        for group in groups:
            if len(group) == 1:
                key = keys[group[0]]
                model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)
        model.checkpoint_groups = [[keys[i] for i in g] for g in groups if len(g) > 1]
    elif mode == "op":
        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block, context_fn=_op_context, preserve_rng_state=False)
    elif mode == "selective":
        for block in model.layers.values():
            core = block.attention.core
            block.attention.core = functools.partial(checkpoint, core, use_reentrant=False)
