"""CUDA's kernels in a fake run: what they save for backward and allocate, where the CPU's differ.

A fake run dispatches the CPU wheel's kernels. Where a GPU run would call a different kernel with a
different memory footprint, ``cuda_kernels()`` routes the call to an
autograd function that allocates and saves exactly what the CUDA kernel does — shapes and dtypes only,
the values of fake tensors mean nothing. Each difference, with its source (PyTorch 2.13):

1. RMSNorm. ``F.rms_norm`` is CompositeImplicitAutograd; on CUDA tensors ``rms_norm_symint``
   (aten/src/ATen/native/layer_norm.cpp) calls the fused ``_fused_rms_norm`` kernel, whose autograd
   node saves the input and ``rstd`` (FP32, one value per row) and whose backward is
   ``_fused_rms_norm_backward``. The CPU path is the composite: ``input.to(float32)``, ``pow``,
   ``mean``, ``rsqrt``, two ``mul``; autograd keeps the FP32 upcast input and the FP32 normalised
   tensor (8 B per element for a BF16 input, against CUDA's 2 B + 4 B per row). On Llama-3-8B at
   s = 8192 this is 12 B · s·b·h per layer (two norms): 12 GiB over 32 layers. Emulated.
2. SDPA, causal without a mask. CUDA picks flash attention (cuDNN attention first on sm90/sm100 when
   the runtime cuDNN is newer than 9.15, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
   ``check_prefer_cudnn_attention``; both support GQA natively). Saved for backward, CPU flash
   (``_scaled_dot_product_flash_attention_for_cpu``) and CUDA flash alike: q, k, v, the output and
   the logsumexp, FP32 (b, heads, s); CUDA adds its philox ``rng_state`` (2 × uint64) and an empty
   ``unused`` (flash_api.cpp ``mha_fwd``): 24 B, emulated for the record. The backward differs:
   flash's ``mha_bwd`` allocates ``softmax_d`` FP32 (b, h, s rounded to 128), ``dq_accum`` FP32
   (b, s rounded to 128, h, head_dim rounded to 32) and, with GQA, ``dk_expanded``/``dv_expanded``
   (b, s_k, h, head_dim) in the compute dtype, summed into dk/dv; the CPU kernel accumulates in small
   per-thread buffers. Emulated (the flash workspace; cuDNN's own workspace is not modelled).
3. SDPA with a mask (the runner's context-parallel attention): flash refuses masks, so CUDA runs
   cuDNN (sm90 with a new cuDNN) or memory-efficient attention, which save the bias and a logsumexp
   padded to a multiple of 32 rows; CPU flash saves the same converted mask and an unpadded logsumexp
   (the padding is < 32 rows per head). Not emulated: a named, small difference.
4. AdamW with ``foreach=True`` (the runner's): the same Python (``torch/optim/adam.py``
   ``_multi_tensor_adam`` with ``capturable=False``) on both devices; CUDA's ``_foreach_*`` kernels
   return the same intermediates (``_foreach_sqrt(exp_avg_sq)``: one FP32 copy of the local states,
   ``harness/estimate/buffers.py optimizer_step``). No difference. (``fused=True`` would allocate
   none; the runner does not use it.)
5. BF16 upcasts: the loss is computed in FP32 explicitly (``compose.loss_fn``: ``logits.float()``) on
   both; under autocast (ZeRO-0/1 BF16 runs) linear layers and SDPA run in BF16 on both devices
   (lower-precision lists of the CPU and CUDA autocast policies), and the residual stream stays FP32
   on both, so the norms see FP32 input either way. The upcast that differs is RMSNorm's (item 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from harness.runner.parallel.recompute import OP_SAVE_LIST


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` (CUDA): output in the input's dtype, saves input and FP32 rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        del eps
        out = torch.empty_like(x)
        row = x[(...,) + (slice(0, 1),) * len(normalized_shape)]
        rstd = torch.empty_like(row, dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        ctx.has_weight = weight is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, _rstd, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_w = torch.empty_like(weight) if ctx.has_weight else None
        return grad_x, grad_w, None, None


# The emulated CUDA flash kernel is one operator (a custom op), not an autograd.Function over
# ``new_empty`` calls: selective checkpointing's policy sees operators, and torchtitan's ``op`` policy
# keeps the fused attention kernels' outputs. As a Function its output and logsumexp were recomputed
# under ``op`` (traced: Llama-3-8B, seq 8192, 56 MiB a layer below the engine), as no GPU run does.
@torch.library.custom_op("harness_fake::flash_attention", mutates_args=())
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, d = q.shape
    out = q.new_empty((b, s, h, d)).transpose(1, 2)  # flash writes (b, s, h, d)
    lse = q.new_empty((b, h, s), dtype=torch.float32)
    return out, lse


@_flash_attention.register_fake
def _(q, k, v):
    b, h, s, d = q.shape
    return q.new_empty((b, s, h, d)).transpose(1, 2), q.new_empty((b, h, s), dtype=torch.float32)


def _flash_setup(ctx, inputs, output):
    q, k, v = inputs
    out, lse = output
    rng_state = q.new_empty((2,), dtype=torch.int64)  # uint64[2] on CUDA
    unused = q.new_empty((), dtype=torch.int64)
    ctx.save_for_backward(q, k, v, out, lse, rng_state, unused)
    # As aten's flash op (derivatives.yaml: only the output is differentiable): no zero-filled gradient
    # of the logsumexp is made for backward.
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _flash_backward(ctx, grad_out, grad_lse):
    q, k, v = ctx.saved_tensors[:3]  # (out, lse, rng_state, unused: read by the kernel)
    if grad_out is None:  # nothing flowed back through the output
        return None, None, None
    b, h, s_q, d = q.shape
    h_k, s_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = q.new_empty((b, h, _round_up(s_q, 128)), dtype=torch.float32)
    dq_accum = q.new_empty(
        (b, _round_up(s_q, 128), h, _round_up(d, 32 if d <= 128 else 64)), dtype=torch.float32
    )
    if h_k != h:  # GQA: gradients for every query head, then summed per KV head
        dk_expanded = q.new_empty((b, s_k, h, d))
        dv_expanded = q.new_empty((b, s_k, h, d))
        del dk_expanded, dv_expanded
    del softmax_d, dq_accum
    return dq, dk, dv


_flash_attention.register_autograd(_flash_backward, setup_context=_flash_setup)
FLASH_OP = torch.ops.harness_fake.flash_attention.default
OP_SAVE_LIST.add(FLASH_OP)  # it stands for aten's flash and cuDNN kernels, which are on the list


class FlashAttention:
    """CUDA flash attention (causal, no mask, GQA native): saves q, k, v, out, FP32 logsumexp and the
    philox state; backward allocates flash's ``mha_bwd`` workspace."""

    @staticmethod
    def apply(q, k, v):
        return FLASH_OP(q, k, v)[0]


def _plain(*tensors) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) for t in tensors)


def _rms_norm(cpu_rms_norm):
    def rms_norm(input, normalized_shape, weight=None, eps=None):
        return FusedRMSNorm.apply(input, weight, tuple(normalized_shape), eps)

    return rms_norm


def _sdpa(cpu_sdpa):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        plain = _plain(query, key, value) and query.dtype != torch.float32
        if attn_mask is None and is_causal and not dropout_p and plain and kw.get("scale") is None:
            return FlashAttention.apply(query, key, value)
        return cpu_sdpa(query, key, value, attn_mask, dropout_p, is_causal, **kw)

    return scaled_dot_product_attention


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """CUDA's kernels' saved tensors and workspaces for the calls this module emulates:
    ``F.rms_norm`` and mask-free causal ``F.scaled_dot_product_attention`` (BF16/FP16; FP32 would run
    memory-efficient attention on CUDA, whose saved tensors equal CPU flash's but for the logsumexp's
    padding to 32 rows) are replaced in ``torch.nn.functional`` for the duration (a fake run's own
    process). Replacing the functions, not a ``TorchFunctionMode`` over every call, keeps the trace's
    cost: a mode doubled it (52 s against 28 s on the 8B point)."""
    saved = F.rms_norm, F.scaled_dot_product_attention
    F.rms_norm, F.scaled_dot_product_attention = _rms_norm(saved[0]), _sdpa(saved[1])
    try:
        yield
    finally:
        F.rms_norm, F.scaled_dot_product_attention = saved
