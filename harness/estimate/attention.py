"""Attention's terms beside the fused kernel's (activations.layer_activation_bytes adds them): the
rotary tables each layer casts, and what SDPA's math kernel keeps (ESTIMATOR.md §3)."""

from __future__ import annotations

from harness.estimate.dtypes import elem_bytes
from harness.spec import ModelSpec, ParallelSpec, TrainSpec


def rope_table_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """The runner's rotary tables in the compute dtype, per layer and micro-batch: ``Attention.forward``
    casts its FP32 cos and sin rows (s/c × head_dim, shared by the batch and the heads, so not split by
    t) to the queries' dtype, and the two multiplications that rotate Q and K save them — a new pair in
    every layer's forward; in FP32 the cast is the buffer itself. Saved tensors of one ``tiny`` block
    under BF16 autocast (torch 2.13, CPU): two (512, 32) BF16 tables, the only tensors the engine did
    not count."""
    if t.precision == "fp32":
        return 0
    return 2 * elem_bytes(t.precision) * (t.seq_len // p.cp) * m.head_size


def math_attention_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, kv_div: int, engine: str) -> int:
    """What the math kernel keeps beyond the fused one, in bytes: the softmax output a·s²·b (both
    batched matmuls' backward and the softmax's own need it; the scores before it are freed — no
    dropout in Llama, so nothing else of Korthikanti's 5as/h) at (s/c)·s per head and a/t heads; and
    K and V repeated to all a heads (the math path's ``repeat_interleave`` copies, saved instead of the
    k-head tensors the fused kernel keeps), divided like K and V (``kv_div``).

    In FP32 that is the softmax and 2·sbh·(1 − k/a) more. With BF16 (or FP16) inputs, torch's math
    path computes in FP32 (``_scaled_dot_product_attention_math`` upcasts query, key and value "for
    accuracy", on every device): it keeps FP32 copies of Q and of the repeated K and V and an FP32
    softmax, in place of the BF16 Q, K and V the fused kernel keeps. Measured on one ``tiny`` block
    (s 512, b 4, FP32, saved-bytes of the allocator's stream): 16.97 sbh more than flash, against
    a·s²·b/sbh = 16 and 2·(1 − 1/2) = 1; BF16 (saved tensors of SDPA's math backend, torch 2.13):
    q·scale, kᵀ, v and the probabilities all FP32. The BF16 CPU study measured the single-rank math
    points 13-16 % above the engine that counted them in BF16. The megatron engine counts Megatron's
    unfused attention, which computes in the compute dtype."""
    s, b = t.seq_len, t.micro_batch_size
    e = elem_bytes(t.precision)
    wide = 4 if engine == "torch" else e
    softmax = m.num_heads * (s // p.cp) * s * b // p.tp
    kv_repeated = 2 * s * b * m.q_width // kv_div
    kv_own = 2 * s * b * m.kv_width // kv_div  # counted by the caller at e
    q = s * b * m.q_width // (p.tp * p.cp)  # counted by the caller at e
    return wide * (softmax + kv_repeated) - e * kv_own + (wide - e) * q
