"""Tensor parallelism (Megatron layout) with optional sequence parallelism, as DTensor plans.

The plan is torchtitan's Llama plan: column-parallel Q/K/V and SwiGLU gate/up, row-parallel output
projections; with sequence parallelism the norms run on sequence shards and the inputs of attention and
MLP are all-gathered (``PrepareModuleInput``). The head's output stays vocabulary-sharded for
``loss_parallel`` when the loss is computed on this rank's logits directly (no pipeline).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ReplicateParallel(ParallelStyle):
    """A module computed whole on every tensor-parallel rank, its parameters as replicated DTensors.

    Without sequence parallelism the norms are not sharded; left as plain tensors, their weights would
    sit beside DTensors in one ``foreach`` AdamW call, which DTensor refuses ("mixed torch.Tensor and
    DTensor"). PyTorch 2.13 has no style for this; ``distribute_module`` builds it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, partition, to_dtensor, to_local)


def layer_plan(*, sequence_parallel: bool) -> dict:
    """Module path (inside one TransformerBlock) → parallel style."""
    if not sequence_parallel:
        return {
            "attention_norm": ReplicateParallel(),
            "ffn_norm": ReplicateParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def model_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Embedding, final norm and head of a (possibly partial) model → parallel style."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard ``model`` (a Llama or a pipeline stage of one) over ``tp_mesh`` in place."""
    parallelize_module(
        model, tp_mesh, model_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, layer_plan(sequence_parallel=sequence_parallel))
