"""Model FLOPs per step, and the dense BF16 peak of known devices (for MFU).

ESTIMATOR.md §7. Megatron-LM's ``num_floating_point_operations`` for Llama with GQA and SwiGLU:

  F = 12·B·s·L·h²·[ (1 + k/a + s/h) + 1.5·f/h + v/(2·L·h) ]      (B = global batch in sequences)

i.e. 6·tokens·(non-embedding matrix parameters + head) plus attention 12·B·s²·L·h. Convention
``megatron`` counts the full s×s attention; ``megatron_causal`` uses s/(2h) (Megatron's 2025 change that
counts the causal mask). Every figure records its convention (the ``flops_convention`` column).
"""

from __future__ import annotations

import math
from functools import lru_cache

from harness.estimate.params import chunk_blocks
from harness.spec import ModelSpec, RunSpec, stage_views

FLOPS_CONVENTIONS = ("megatron", "megatron_causal")

# Dense BF16 peak TFLOP/s by device name, most specific first: the first pattern contained in the
# (lower-cased) name wins, so "h100 nvl" is tried before "h100". Vendor data sheets.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("h100 nvl", 835.0),
    ("h100 pcie", 756.0),
    ("h100", 989.0),  # SXM5 80 GB and 94 GB
    ("h200", 989.0),
    ("h20", 148.0),
    ("a100", 312.0),
    ("a10g", 70.0),
    ("l40s", 362.0),
)


def peak_tflops_for(device_name: str) -> float:
    """Dense BF16 peak of a device from its name; NaN when unknown (never a guess)."""
    name = device_name.lower().replace("-", " ").replace("_", " ")
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if pattern in name:
            return tflops
    return math.nan


def model_flops_per_step(spec: RunSpec, *, convention: str = "megatron") -> int:
    """Model FLOPs of one optimizer step of the whole job (forward + backward, all ranks)."""
    if convention not in FLOPS_CONVENTIONS:
        raise ValueError(f"flops convention {convention!r} must be one of {', '.join(FLOPS_CONVENTIONS)}")
    return _model_flops(spec.model, spec.train.seq_len, spec.global_batch_size, convention)


@lru_cache(maxsize=4096)  # (plan asks it of every candidate; few differ in model, sequence and batch)
def _model_flops(m: ModelSpec, s: int, B: int, convention: str) -> int:
    h, L = m.hidden_size, m.num_layers
    # The bracket multiplied out, in integers (h·k/a is whole because h % a == 0):
    # 12BsLh·(h + h·k/a + s_attn) + 18BsLh·f + 6Bs·h·v, with s_attn = s, or s/2 counting the causal mask.
    # Q, K, V, O of widths a·d and k·d (= h and h·k/a unless a head size of its own, Qwen3's head_dim);
    # the attention's two matmuls over a·d.
    q, kv = m.q_width, m.kv_width
    attn = 12 * B * s * L * q * s if convention == "megatron" else 6 * B * s * L * q * s
    # the MLP's: a mixture of experts' from its active parameters (dense first layers a dense MLP's)
    mlp = B * s * sum(n * mlp_flops_per_token(kind) for kind, n in chunk_blocks(m, 1))
    return 12 * B * s * L * h * (q + kv) + attn + mlp + 6 * B * s * h * m.vocab_size


def mlp_flops_per_token(m: ModelSpec) -> int:
    """Forward and backward FLOPs of one block's MLP per token: 18·h·f for SwiGLU (three h×f matmuls,
    6 FLOPs per multiply-add weight), or a mixture of experts' active parameters
    (:func:`harness.estimate.moe.moe_mlp_flops_per_token`)."""
    if m.moe:
        from harness.estimate.moe import moe_mlp_flops_per_token

        return moe_mlp_flops_per_token(m)
    return 18 * m.hidden_size * m.ffn_hidden_size


def hardware_flops_per_step(spec: RunSpec, *, convention: str = "megatron") -> int:
    """FLOPs the hardware executes: full recomputation runs the forward of every block a checkpoint covers
    once more (forward is a third of forward + backward: 4/3 of the model FLOPs when every block is
    covered, as is the convention, head included; with ``recompute_every`` or Megatron's methods the
    covered blocks' share of it); selective recomputation of the attention core adds its forward,
    4·B·s²·L·h (the s/h term's share of the forward pass)."""
    from harness.estimate.checkpoints import recomputed_layers

    model = model_flops_per_step(spec, convention=convention)
    t, m, p = spec.train, spec.model, spec.parallel
    if t.recompute == "full":
        views = stage_views(spec)  # each stage's own blocks (pp_layers)
        covered = sum(recomputed_layers(v.model, v.parallel, t) * p.virtual_stages for v in views)
        if covered >= m.num_layers:
            return (4 * model + 1) // 3
        return model + model * covered // (3 * m.num_layers)
    if t.recompute == "selective":
        core = 4 if convention == "megatron" else 2  # 4·B·s·s_attn·L·h with s_attn = s or s/2
        return model + core * spec.global_batch_size * t.seq_len**2 * m.num_layers * m.hidden_size
    return model
