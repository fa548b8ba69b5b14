"""Tensor parallelism (Megatron layout) with optional sequence parallelism, as DTensor plans.

The plan is torchtitan's Llama plan: column-parallel Q/K/V and SwiGLU gate/up, row-parallel output
projections; with sequence parallelism the norms run on sequence shards and the inputs of attention and
MLP are all-gathered (``PrepareModuleInput``). The head's output stays vocabulary-sharded for
``loss_parallel`` when the loss is computed on this rank's logits directly (no pipeline).

Tied embeddings stay tied: the embedding (row-parallel) and the head (column-parallel) both shard the
(v, h) matrix by vocabulary rows, ``Shard(0)``, so after ``parallelize_module`` (which gives each module
a DTensor of its own) the head takes the embedding's. Before this, tp > 1 trained a tied model untied
(issue 15).
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
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel._data_parallel_utils import sync_grad_hook


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


def layer_plan(*, sequence_parallel: bool, block: nn.Module | None = None) -> dict:
    """Module path (inside one TransformerBlock) → parallel style; a block whose MLP is a mixture of
    experts (``block.mlp_name == "moe"``) gets :func:`moe_plan` for it."""
    moe = block is not None and block.mlp_name == "moe"
    if not sequence_parallel:
        plan = {
            "attention_norm": ReplicateParallel(),
            "ffn_norm": ReplicateParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
        }
        if not moe:
            plan.update(
                {
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        return plan | (moe_plan(block, sequence_parallel=False) if moe else {})
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if not moe:
        plan.update(
            {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    return plan | (moe_plan(block, sequence_parallel=True) if moe else {})


def moe_plan(block: nn.Module, *, sequence_parallel: bool) -> dict:
    """A mixture of experts under tensor parallelism, every tp rank computing the whole layer on every
    token of its sequence: the router replicated (its FP32 matmul on the replicated weight's local copy:
    the same gradient on every tp rank), each expert and the shared experts sharded as a dense MLP is
    (w1, w3 by column, w2 by row), their outputs all-reduced, so that the gate values multiply whole
    outputs and the combine is replicated. With sequence parallelism the layer's input is all-gathered
    and its output cut back to this rank's sequence shard. Megatron's default expert tensor parallelism
    (ETP = TP) shards the experts the same way (it routes sequence shards and all-gathers the rows over
    TP instead); torchtitan's last DTensor plan (a2b5ee66) routes every token on every tp rank as here,
    with the experts' outputs reduced once at the layer's end. Each expert's all-reduce keeps the
    router's gradient whole without a Partial placement (torchtitan's ``NoParallel`` with Partial
    gradients scaled the router's input gradient by tp: docs/mixture-of-experts.md)."""
    moe = block.moe
    plan: dict = {"moe.router": ReplicateParallel()}
    mlps = [f"moe.experts.{key}" for key in moe.experts] + (["moe.shared"] if moe.shared is not None else [])
    for path in mlps:
        plan.update(
            {
                f"{path}.w1": ColwiseParallel(),
                f"{path}.w2": RowwiseParallel(),
                f"{path}.w3": ColwiseParallel(),
            }
        )
    if sequence_parallel:
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    return plan


def model_plan(
    model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool, chunked_loss: bool = False
) -> dict:
    """Embedding, final norm and head of a (possibly partial) model → parallel style. ``chunked_loss``
    (``train.loss_chunks`` > 1): the head takes each slice of the hidden states whole on every rank
    (parallel/loss.py gathers them first), as torchtitan's does."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Replicate() if chunked_loss else seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    chunked_loss: bool = False,
) -> None:
    """Shard ``model`` (a Llama or a pipeline stage of one) over ``tp_mesh`` in place."""
    tied = model.spec.tie_embeddings and model.tok_embeddings is not None and model.output is not None
    plan = model_plan(
        model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, chunked_loss=chunked_loss
    )
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0): one parameter again
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, layer_plan(sequence_parallel=sequence_parallel, block=block))


def localize_for_ddp(model: nn.Module) -> None:
    """Expose DTensor parameters to DDP as local tensors, DTensors again during forward: PyTorch's
    ``_pre_dp_module_transform`` (its recipe for DDP + TP), keeping shared parameters shared.

    PyTorch's version walks ``named_parameters()``, which names a shared parameter once, so it swaps the
    embedding's weight and leaves the tied head holding the old DTensor, untied again. Here every
    (module, name) that holds a parameter is swapped together.
    """
    holders: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, param in mod.named_parameters(recurse=False):
            if isinstance(param, DTensor):
                holders.setdefault(param, []).append((mod, name))
    table = []
    for param, where in holders.items():
        local = nn.Parameter(param._local_tensor)
        # Gradients arriving as async collective results are waited on before DDP reads them.
        local.register_hook(sync_grad_hook)
        table.append((local, param._spec, where))

    # Per module that holds them, not on the root as torch's recipe does: activation checkpointing
    # runs a block's forward again during backward, after the root's forward has ended and its
    # parameters are local tensors again — with the root's hooks the recomputed block met plain
    # weights beside DTensor activations and crashed (issue 30: cp × tp with any recomputation).
    # Each holder's forward makes its DTensors from the shared local parameter, so gradients of a
    # tied pair still meet in one ``.grad``.
    by_module: dict[nn.Module, list[tuple[str, nn.Parameter, object]]] = {}
    for local, spec, where in table:
        for mod, name in where:
            by_module.setdefault(mod, []).append((name, local, spec))

    def localize(mod: nn.Module, *_: object) -> None:
        for name, local, _spec in by_module[mod]:
            delattr(mod, name)
            mod.register_parameter(name, local)

    def reconstruct(mod: nn.Module, *_: object) -> None:
        for name, local, spec in by_module[mod]:
            full = DTensor.from_local(
                local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
            )
            delattr(mod, name)
            setattr(mod, name, full)  # a plain attribute for this forward, not a parameter

    for mod in by_module:
        localize(mod)
        mod.register_forward_pre_hook(reconstruct)
        mod.register_forward_hook(localize)
