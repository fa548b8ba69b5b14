"""Model FLOPs per step by hand, and the peak-TFLOP/s table."""

from __future__ import annotations

import math

import pytest
from conftest import spec

from harness.estimate.flops import hardware_flops_per_step, model_flops_per_step, peak_tflops_for


def test_tiny_model_flops_by_hand():
    # tiny (h 128, L 4, k/a 1/2, f 352, v 4096), s 256, one sequence: T = 256 tokens.
    s = spec("tiny", train_seq_len=256)
    tokens = 256
    # 6·T·(matrix parameters of the layers + head): layers 4·184,320, head 128·4096 = 524,288.
    dense = 6 * tokens * (4 * 184_320 + 524_288)
    # Attention 12·L·h·s·T (QKᵀ and AV, forward and backward): 12·4·128·256·256.
    attention = 12 * 4 * 128 * 256 * tokens
    assert model_flops_per_step(s) == dense + attention
    # Causal convention halves the attention term.
    assert model_flops_per_step(s, convention="megatron_causal") == dense + attention // 2


def test_flops_scale_with_global_batch_and_recompute():
    s = spec("tiny", parallel_dp=2, train_micro_batch_size=2, train_num_microbatches=3)
    assert model_flops_per_step(s) == 12 * model_flops_per_step(spec("tiny"))
    full = spec("tiny", train_recompute="full")
    assert hardware_flops_per_step(full) == round(model_flops_per_step(full) * 4 / 3)
    sel = spec("tiny", train_recompute="selective")
    assert hardware_flops_per_step(sel) == model_flops_per_step(sel) + 4 * 256 * 256 * 4 * 128
    # tiny has 4 layers: every 2nd block checkpointed runs 2 of 4 forwards again, a sixth of the model
    # FLOPs (the forward is a third); Megatron's block method with N 1, one of 4: a twelfth.
    every2 = spec("tiny", train_recompute="full", train_recompute_every=2)
    assert (
        hardware_flops_per_step(every2)
        == model_flops_per_step(every2) + model_flops_per_step(every2) * 2 // 12
    )
    block1 = spec("tiny", train_recompute="full", train_recompute_every=1, train_recompute_method="block")
    assert (
        hardware_flops_per_step(block1) == model_flops_per_step(block1) + model_flops_per_step(block1) // 12
    )


def test_unknown_convention_is_an_error():
    with pytest.raises(ValueError, match="convention"):
        model_flops_per_step(spec("tiny"), convention="guess")


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("h100_94gb", 989.0),
    ],
)
def test_peak_table_most_specific_first(name, tflops):
    assert peak_tflops_for(name) == tflops


@pytest.mark.parametrize("name", ["NVIDIA A10", "cpu", "Tesla V100-SXM2-32GB"])
def test_unknown_device_is_nan_not_a_guess(name):
    assert math.isnan(peak_tflops_for(name))
