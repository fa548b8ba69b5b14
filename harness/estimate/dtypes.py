"""Bytes per element of what the runner keeps: the compute dtype, where the runner computes under BF16
autocast, and the dtype an RMSNorm keeps (ESTIMATOR.md §3; used by every term module)."""

from __future__ import annotations

from harness.spec import ParallelSpec, TrainSpec


def elem_bytes(precision: str) -> int:
    """Bytes per activation element in the compute dtype."""
    return 2 if precision == "bf16" else 4


def torch_autocast(p: ParallelSpec, t: TrainSpec) -> bool:
    """Whether the runner computes under BF16 autocast (``compose.parallelize``): BF16 runs whose
    parameters neither FSDP2 nor ``replicate`` casts — one data-parallel rank, or DDP (ZeRO 0/1)
    without pipelining."""
    fsdp_like = p.dp * p.cp > 1 and (p.zero_stage >= 2 or p.pp > 1)
    return t.precision == "bf16" and not fsdp_like


def norm_tensors(engine: str, *, fused_norm: bool = False) -> int:
    """Tensors of s·b·h one RMSNorm keeps per norm, twice per layer: the input (megatron), the input
    and the normalised output (torch on CPU: the composite ``F.rms_norm``'s autograd saves both). On a
    GPU (``fused_norm``) ``F.rms_norm`` runs CUDA's fused ``_fused_rms_norm``, which keeps the input
    and an FP32 1/rms per row only (harness/runner/fake/kernels.py 1): the input, as megatron's."""
    return 4 if engine == "torch" and not fused_norm else 2


def norm_elem_bytes(t: TrainSpec, *, engine: str, fused_norm: bool = False, autocast: bool = False) -> int:
    """Bytes per element of what an RMSNorm keeps (:func:`norm_tensors`). torch: FP32 under autocast
    (the residual stream is FP32), and on the CPU whatever the precision: the composite ``F.rms_norm``
    upcasts BF16 input and keeps the FP32 upcast and the FP32 normalised output (saved tensors of a
    BF16 ``F.rms_norm`` on the CPU, torch 2.13: two FP32 (s, h), an FP32 1/rms and the weight). The
    BF16 CPU study's FSDP2 points, whose BF16 comes from FSDP2's parameter dtype without autocast, read
    5-8 % under while these were counted in BF16. CUDA's fused kernel keeps its input in the input's
    dtype."""
    if engine == "torch" and (autocast or not fused_norm):
        return 4
    return elem_bytes(t.precision)
