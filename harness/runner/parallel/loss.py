"""The step's loss: the whole head-and-loss at once, or torchtitan's chunked loss (``train.loss_chunks``).

torchtitan's ``ChunkedLossWrapper`` (``torchtitan/components/loss.py`` at b5bcd76, 8 chunks in its Llama
configs) is followed step for step, because what it holds and when is the point of the key:

1. the model stops after its final norm (``Llama.skip_head``) and returns the hidden states;
2. they are detached and split into N slices of the rank's tokens, each a leaf;
3. under FSDP2 the head's unit is gathered once and kept through the loop (not resharded after forward
   or backward), its gradient reduced only at the last slice (``set_requires_gradient_sync``);
4. for each slice: the head, the FP32 cross-entropy, and that slice's backward at once, its hidden-state
   gradient copied into one FP32 buffer of the whole (tokens, h);
5. the loss returned carries that buffer, in the compute dtype, as the hidden states' gradient
   (``_HiddenGradient``), so the step's ordinary backward (or the pipeline schedule's) runs on
   through the blocks.

Under tensor parallelism the slices are whole on every tp rank (sequence parallelism's output gathered
first, as torchtitan's plan does), the head's logits vocabulary-sharded under loss parallelism, and each
slice's hidden-state gradient all-reduced as it is made (torchtitan keeps it partial and reduces the
buffer once). Under DDP the head is left out of the reducer and averaged by hand
(``compose.sync_head_grad``).

Written here, not imported: torchtitan is not a dependency, and its wrapper works on its own
model's (tokens, h) layout and its SPMD type checker. The loss is the mean over the rank's tokens
times ``scale``, as :func:`loss_fn`'s; each slice's backward runs on its own part of that sum, so the
gradients are the unchunked loss's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in FP32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _HiddenGradient(torch.autograd.Function):
    """The loss's value, with the slices' accumulated gradient handed to the hidden states in backward
    (torchtitan's ``_DecoderOutputGradientBackProp``). The gradient arriving from the loss is 1: the
    scale was applied to each slice's backward already."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def _fsdp_head(head: nn.Module) -> bool:
    return hasattr(head, "set_requires_gradient_sync") and hasattr(head, "unshard")


def chunked_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module,
    *,
    chunks: int,
    scale: float = 1.0,
    backward: bool = True,
) -> torch.Tensor:
    """The loss of ``head(hidden)`` against ``targets`` over ``chunks`` slices of the tokens, each
    slice's backward run now (module docstring). ``hidden`` (batch, seq, h), ``targets`` (batch, seq).
    ``backward`` False: the slices' backwards are not run and the hidden states' gradient is zeros (a
    pipeline's metadata inference, :class:`PipelineLoss`)."""
    mesh = None
    if isinstance(hidden, DTensor):
        # Sequence parallelism: the norm's output is sequence-sharded; every tensor-parallel rank runs
        # the head on whole slices (torchtitan's plan gathers them too). Its gradient comes back whole.
        mesh = hidden.device_mesh
        hidden = hidden.redistribute(placements=[Replicate()] * mesh.ndim)
    local = hidden.to_local() if mesh is not None else hidden
    tokens = local.shape[0] * local.shape[1]
    h_all = local.detach().reshape(tokens, local.shape[-1])
    y_all = targets.reshape(tokens)
    train = hidden.requires_grad
    if train and not backward:
        with torch.no_grad():
            total = chunked_loss(local.detach(), targets, head, chunks=chunks, scale=scale)
        return _HiddenGradient.apply(hidden, torch.zeros_like(hidden), total)
    grad = torch.zeros(h_all.shape, dtype=torch.float32, device=h_all.device) if train else None
    fsdp = train and _fsdp_head(head)
    if fsdp:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    total = torch.zeros((), dtype=torch.float32, device=h_all.device)
    size = tokens // chunks
    for i in range(chunks):
        part = slice(i * size, (i + 1) * size)
        h = h_all[part].contiguous().requires_grad_(train)
        if fsdp and i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(h)
        # (under tp: vocabulary-sharded logits; compose.train_step's loss_parallel covers the slices)
        loss = F.cross_entropy(logits.float(), y_all[part], reduction="sum") * (scale / tokens)
        total = total + (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if train:
            loss.backward()
            grad[part] = h.grad  # whole: the head's input hook reduced it over the tp ranks
            h.grad = None
        del logits, loss, h
    if fsdp:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.reshard()
    if not train:
        return total
    grad = grad.to(local.dtype).view(local.shape)
    if mesh is not None:
        grad = DTensor.from_local(grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return _HiddenGradient.apply(hidden, grad, total)


class PipelineLoss:
    """A pipeline schedule's ``loss_fn`` under ``train.loss_chunks`` (the schedule scales the gradients
    by the micro-batches itself).

    torch 2.13's schedules infer the stages' shapes on their first step by running the last stage's
    forward and ``loss_fn`` on uninitialised tensors, then asking autograd for the input gradients
    only. The slices' backwards would add that pass's head gradient to the step's (found by loss
    equality: pp 2 read 8.1293 where the reference reads 8.1133 after one step), so until the
    schedule says its backward is set up (a private flag; a torch without it is taken as set up) the
    loss runs without them. torchtitan's ``ChunkedLossWrapper`` under its pipelines has no such guard."""

    def __init__(self, head: nn.Module, chunks: int, loss_parallel: bool = False):
        self.head, self.chunks, self.loss_parallel = head, chunks, loss_parallel
        self.schedule: object | None = None

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ready = getattr(
            self.schedule,
            "_stage_backward_initialized",
            getattr(self.schedule, "_stages_backward_initialized", True),
        )
        # Under tp the head's output stays vocabulary-sharded: every slice's loss and backward run here
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            return chunked_loss(hidden, targets, self.head, chunks=self.chunks, backward=bool(ready))
