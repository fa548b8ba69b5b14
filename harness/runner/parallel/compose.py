"""Apply the parallelisms to one rank's model in a fixed order, and run one training step.

Order (torchtitan's, STYLE.md 5): pipeline split first, then tensor parallel, context parallel,
activation recomputation, and data parallel / FSDP last, so that each wrapper sees the modules the
previous one produced. The mesh is (pp, dp, cp, tp), innermost tp: tp ranks are adjacent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from harness.runner.parallel.context import apply_cp
from harness.runner.parallel.data import apply_ddp, apply_fsdp, apply_replicate, make_optimizer
from harness.runner.parallel.expert import apply_ep, expert_meshes, set_aux_loss_scale, sync_expert_grads
from harness.runner.parallel.loss import PipelineLoss, chunked_loss, loss_fn
from harness.runner.parallel.materialize import materialize, on_meta
from harness.runner.parallel.pipeline import build_schedule, split_stage, stage_ids
from harness.runner.parallel.recompute import apply_recompute
from harness.runner.parallel.tensor import apply_tp
from harness.spec import RunSpec, chunk_layer_ranges

MESH_DIMS = ("pp", "dp", "cp", "tp")
LEARNING_RATE = 1e-3
ADAM_EPS = 1e-8  # the correctness tests raise it: see tests/runner/test_runner_parallel.py


@dataclass
class Parallelized:
    """One rank's share of the job: its stage module(s), optimizer and, with pp > 1, the schedule."""

    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: object | None
    is_first: bool
    is_last: bool
    loss_parallel: bool
    autocast_dtype: torch.dtype | None
    positions: torch.Tensor | None = None
    # Tied embeddings under pipelining: this rank's copy of the shared matrix (embedding on the first
    # stage, head on the last) and the group of the two stages that hold it.
    tied_weight: nn.Parameter | None = None
    tied_group: object | None = None
    # train.grad_sync: reduce gradients after every micro-batch, or only after the last
    grad_sync: str = "last"
    # Expert parallelism under DDP: the experts' gradients, which DDP ignores, are reduced by hand over
    # the expert data-parallel group (parallel/expert.py); dp·cp, their divisor.
    expert_sync: DeviceMesh | None = None
    shards: int = 1
    # train.loss_chunks > 1: the head the chunked loss runs (parallel/loss.py), on the last stage
    loss_chunks: int = 1
    head: nn.Module | None = None
    head_sync: DeviceMesh | None = None  # DDP: the head's gradient is averaged by hand (sync_head_grad)


def parallelize(model: nn.Module, spec: RunSpec, mesh: DeviceMesh, device: torch.device) -> Parallelized:
    p, t = spec.parallel, spec.train
    bf16 = t.precision == "bf16"
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if p.dp * p.cp > 1 else None
    ep_mesh, edp_mesh = expert_meshes(dp_cp, p.ep)
    pp_rank = mesh["pp"].get_local_rank()
    num_stages = p.pp * p.virtual_stages
    ids = stage_ids(pp_rank=pp_rank, pp=p.pp, virtual_stages=p.virtual_stages) if p.pp > 1 else [0]
    blocks = chunk_layer_ranges(spec)
    modules = (
        [split_stage(model, stage=i, num_stages=num_stages, blocks=blocks[i]) for i in ids]
        if p.pp > 1
        else [model]
    )
    # Vocabulary-sharded logits straight into the loss, except under pipelining, whose stages send
    # and return plain tensors: there the head's output is gathered.
    # The chunked loss runs the head inside the schedule's loss, whose slices can keep it sharded
    # (parallel/loss.PipelineLoss), as torchtitan's does.
    use_loss_parallel = p.tp > 1 and (p.pp == 1 or t.loss_chunks > 1)
    positions = None
    # Built on the meta device (the worker): memory and weights come after sharding (materialize.py).
    meta = on_meta(model)
    for mod in modules:
        if not meta and next(mod.parameters()).device != device:  # (a no-op .to() fails on fake tensors)
            mod.to(device)
        if p.tp > 1:
            apply_tp(
                mod,
                mesh["tp"],
                sequence_parallel=p.sequence_parallel,
                loss_parallel=use_loss_parallel,
                chunked_loss=t.loss_chunks > 1,
            )
        if p.cp > 1:
            positions = apply_cp(mod, mesh["cp"], seq_len=t.seq_len, load_balance=p.cp_load_balance)
        if ep_mesh is not None:
            apply_ep(mod, ep_mesh, dp_cp, seq_len=t.seq_len, cp=p.cp, load_balance=p.cp_load_balance)
        if spec.model.moe_aux_loss_coeff:
            # the load-balancing loss's gradient at the loss's own scale: 1/micro-batches here, 1 where
            # the pipeline schedule scales every gradient itself (scale_grads)
            set_aux_loss_scale(mod, 1.0 if p.pp > 1 else 1 / t.num_microbatches)
        apply_recompute(mod, mode=t.recompute, every=t.recompute_every, method=t.recompute_method)
        if t.loss_chunks > 1 and mod.output is not None:
            mod.skip_head = True
    fsdp = p.zero_stage >= 2 and dp_cp is not None
    head_sync = None
    if meta and not fsdp:  # DDP and replicate start from materialized parameters (DDP broadcasts them)
        materialize(modules, device, spec.model)
    if fsdp:
        for mod in modules:
            apply_fsdp(
                mod,
                dp_cp,
                reshard_after_forward=p.zero_stage == 3,
                keep_head=p.zero_stage == 3 and p.fsdp_reshard_after_forward == "default",
                chunked_loss=t.loss_chunks > 1,
                param_dtype=torch.bfloat16 if bf16 else torch.float32,
                experts_mesh=edp_mesh if ep_mesh is not None else None,
            )
        if meta:  # FSDP2 shards the meta parameters: each rank allocates only its shards
            materialize(modules, device, spec.model)
    elif dp_cp is not None and p.pp > 1:
        for mod in modules:
            apply_replicate(
                mod,
                dp_cp,
                param_dtype=torch.bfloat16 if bf16 else torch.float32,
                experts_mesh=edp_mesh if ep_mesh is not None else None,
            )
    elif dp_cp is not None:
        head_sync = dp_cp if t.loss_chunks > 1 else None  # (DDP ignores the head: sync_head_grad)
        modules = [
            apply_ddp(
                mod,
                dp_cp,
                tensor_parallel=p.tp > 1,
                ignore_experts=ep_mesh is not None,
                ignore_head=t.loss_chunks > 1,
            )
            for mod in modules
        ]
    tied_weight, tied_group = None, None
    if spec.model.tie_embeddings and p.pp > 1:
        tied_group = tied_embedding_group(mesh)
        ends = [m.tok_embeddings.weight for m in modules if m.tok_embeddings is not None]
        ends += [m.output.weight for m in modules if m.output is not None]
        tied_weight = ends[0] if ends else None
    bare = [getattr(m, "module", m) for m in modules]  # (inside DDP)
    heads = [m.output for m in bare if m.output is not None] if t.loss_chunks > 1 else []
    head = heads[0] if heads else None
    params = [q for mod in modules for q in mod.parameters()]
    optimizer = make_optimizer(params, zero_stage=p.zero_stage, mesh=dp_cp, lr=LEARNING_RATE, eps=ADAM_EPS)
    schedule = None
    if p.pp > 1:
        pipeline_loss = PipelineLoss(head, t.loss_chunks, p.tp > 1) if head is not None else loss_fn
        schedule = build_schedule(
            modules,
            ids,
            num_stages=num_stages,
            group=mesh["pp"].get_group(),
            device=device,
            schedule=p.pp_schedule,
            num_microbatches=t.num_microbatches,
            loss_fn=pipeline_loss,
        )
        if head is not None:
            pipeline_loss.schedule = schedule
    # FSDP2 and replicate cast parameters themselves; DDP and single-rank BF16 runs use autocast.
    fsdp_like = dp_cp is not None and (p.zero_stage >= 2 or p.pp > 1)
    autocast = torch.bfloat16 if (bf16 and not fsdp_like) else None
    return Parallelized(
        modules=modules,
        optimizer=optimizer,
        schedule=schedule,
        is_first=0 in ids,
        is_last=num_stages - 1 in ids,
        loss_parallel=use_loss_parallel,
        autocast_dtype=autocast,
        positions=positions,
        tied_weight=tied_weight,
        tied_group=tied_group,
        grad_sync=t.grad_sync,
        expert_sync=edp_mesh if ep_mesh is not None and not fsdp_like else None,
        shards=p.dp * p.cp,
        loss_chunks=t.loss_chunks,
        head=head,
        head_sync=head_sync,
    )


@torch.no_grad()
def sync_head_grad(par: Parallelized) -> None:
    """DDP under the chunked loss: the head's gradient, which DDP ignores (data.apply_ddp), averaged
    over the data-parallel ranks by hand, as DDP would have."""
    if par.head_sync is None or par.head.weight.grad is None:
        return
    weight = par.head.weight
    dist.all_reduce(weight.grad, group=par.head_sync.get_group())
    weight.grad.div_(par.head_sync.size())


def tied_embedding_group(mesh: DeviceMesh):
    """The group of the first and the last pipeline stage's ranks at this rank's (dp, cp, tp) position
    (Megatron's embedding group), or None where this rank is on neither end.

    Under pipelining a tied model holds two copies of the shared matrix, the embedding on the first
    stage and the head on the last; summing their gradients there before every optimizer step keeps
    the copies equal (Megatron's ``_allreduce_embedding_grads``). Every rank creates every group, in the
    same order, as ``new_group`` requires."""
    # The mesh is init_device_mesh's: global ranks 0 … world − 1 in row-major (pp, dp, cp, tp) order, so
    # stage s holds ranks s·n … (s + 1)·n − 1. Computed, not read from ``mesh.mesh``: a fake run builds
    # this under FakeTensorMode, which refuses to index that real tensor (issue 30).
    pp = mesh["pp"].size()
    n = mesh.size() // pp
    mine = None
    for a, b in zip(range(n), range((pp - 1) * n, pp * n), strict=True):
        group = dist.new_group([a, b])
        if dist.get_rank() in (a, b):
            mine = group
    return mine


@torch.no_grad()
def sync_tied_weight(par: Parallelized) -> None:
    """Sum the tied matrix's gradient over the first and last stage (see :func:`tied_embedding_group`).

    Under tp the two ends' gradients are laid out differently: the head's is vocabulary-sharded like
    its weight, the embedding's comes back replicated (DTensor's embedding backward); both are brought
    to the weight's own layout, the same on both ends, before they are summed."""
    weight = par.tied_weight
    if weight is None or weight.grad is None:
        return
    grad = weight.grad
    if hasattr(grad, "redistribute"):
        if grad.placements != weight.placements:
            grad = weight.grad = grad.redistribute(placements=weight.placements)
        grad = grad.to_local()
    dist.all_reduce(grad, group=par.tied_group)


def _sync_context(module: nn.Module, *, last: bool):
    """Skip the gradient reduction of all but the last micro-batch (gradient accumulation); ``last``
    True for every micro-batch under ``train.grad_sync=every_microbatch``."""
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(last)
    elif hasattr(module, "no_sync") and not last:  # DDP
        return module.no_sync()
    return contextlib.nullcontext()


def train_step(
    par: Parallelized, tokens: torch.Tensor, targets: torch.Tensor, *, num_microbatches: int
) -> torch.Tensor | None:
    """One optimizer step on this rank's tokens; returns the mean loss this rank saw as a 0-d tensor
    (None where a pipeline rank holds no last stage). A tensor, not a float: under FakeTensorMode (a dry
    run) there is no value to read."""
    device_type = tokens.device.type
    autocast = (
        torch.autocast(device_type, dtype=par.autocast_dtype)
        if par.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    if par.schedule is not None:
        losses: list[torch.Tensor] = []
        # return_outputs=False: by default the last stage keeps every micro-batch's output (the full
        # logits, b·s·v each) until the step ends, only to return them; training needs the losses only.
        # Seen in this project's CPU study: +140 MiB on a tiny pp=4 run, twice the estimate.
        kw = {"return_outputs": False}
        with autocast:
            if par.is_first and par.is_last:
                par.schedule.step(tokens, target=targets, losses=losses, **kw)
            elif par.is_first:
                par.schedule.step(tokens, **kw)
            elif par.is_last:
                par.schedule.step(target=targets, losses=losses, **kw)
            else:
                par.schedule.step(**kw)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else None
    else:
        model = par.modules[0]
        total = None
        for i, (x, y) in enumerate(
            zip(tokens.chunk(num_microbatches), targets.chunk(num_microbatches), strict=True)
        ):
            sync = _sync_context(model, last=i == num_microbatches - 1 or par.grad_sync == "every_microbatch")
            # loss_parallel must cover backward too: it computes the vocabulary-sharded gradient.
            lp = loss_parallel() if par.loss_parallel else contextlib.nullcontext()
            with sync, lp:
                with autocast:
                    if par.head is not None:
                        # each slice's backward runs inside: the scale goes in with it
                        out = chunked_loss(
                            model(x), y, par.head, chunks=par.loss_chunks, scale=1 / num_microbatches
                        )
                    else:
                        out = loss_fn(model(x), y) / num_microbatches
                out.backward()
            out = (out.full_tensor() if hasattr(out, "full_tensor") else out).detach().float()
            total = out if total is None else total + out
        loss = total
    if par.expert_sync is not None:
        sync_expert_grads(par.modules, par.expert_sync, shards=par.shards)
    sync_head_grad(par)
    sync_tied_weight(par)
    par.optimizer.step()
    par.optimizer.zero_grad(set_to_none=True)
    return loss
