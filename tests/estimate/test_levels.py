"""The reserved and device levels above the allocated peak, with hand-derived numbers."""

from __future__ import annotations

from conftest import spec

from harness.estimate import estimate
from harness.estimate.levels import communicators, segment_rounding

MiB = 1 << 20


def test_segment_rounding_of_single_large_buffers():
    # logits 25 MiB + 1 B → its segment is 26 MiB (2 MiB rounding): 1 MiB - 1 B of tail; a 5 MiB loss
    # shares a 20 MiB segment whose remainder is split off for reuse: nothing; params are not buffers.
    terms = {"logits": 25 * MiB + 1, "loss": 5 * MiB, "params": 33 * MiB + 7}
    assert segment_rounding(terms) == MiB - 1


def test_communicators_one_per_group_used():
    assert communicators(spec("tiny")) == 0  # one rank: no NCCL
    assert communicators(spec("tiny", parallel_dp=2)) == 2  # world + dp
    # world + dp + tp + pp + cp + FSDP's flattened dp x cp
    assert communicators(spec("tiny", parallel_dp=2, parallel_tp=2, parallel_pp=2, parallel_cp=2)) == 6


def test_device_level_adds_context_and_nccl_on_a_gpu_and_nothing_on_the_cpu():
    gpu = estimate(spec("llama3_8b", "h100_80gb", parallel_dp=8, parallel_zero_stage=3, train_seq_len=8192))
    # h100_80gb: CUDA context 512 MiB; 2 communicators (world, dp) x 496 MiB; cuBLAS 64 MiB.
    assert gpu.outside_terms == {"cuda_context": 512 * MiB, "nccl": 2 * 496 * MiB}
    assert gpu.reserved_terms()["cublas_workspace"] == 64 * MiB
    assert gpu.device_total_bytes == gpu.reserved_total_bytes + 1504 * MiB
    assert gpu.reserved_total_bytes >= gpu.total_bytes + 64 * MiB
    record = gpu.as_record(threshold=0.8)
    assert record["fits"] == (record["device_total_bytes"] <= 0.8 * record["capacity_bytes"])
    cpu = estimate(spec("tiny", parallel_dp=2))
    assert cpu.device_total_bytes == cpu.reserved_total_bytes == cpu.total_bytes


def test_nccl_buffers_follow_nccl_buffsize():
    # h100_80gb: 496 MiB per communicator at NCCL's default 4 MiB buffer, 24 channels. A channel maps
    # 4 + 0.5 + 4.69 = 9.19 MiB in 2 MiB granules: 10 MiB; at 8 MiB, 13.19 -> 14 MiB (+4 a channel);
    # at 1 MiB, 6.19 -> 8 MiB (-2 a channel).
    import dataclasses

    from harness.estimate.levels import nccl_bytes

    d = spec("tiny", "h100_80gb").device
    assert nccl_bytes(d) == 496 * MiB
    assert nccl_bytes(dataclasses.replace(d, nccl_buffsize_mib=4.0)) == 496 * MiB
    assert nccl_bytes(dataclasses.replace(d, nccl_buffsize_mib=8.0)) == (496 + 24 * 4) * MiB
    assert nccl_bytes(dataclasses.replace(d, nccl_buffsize_mib=1.0)) == (496 - 24 * 2) * MiB
    s = spec("llama3_8b", "h100_80gb", parallel_dp=8, parallel_zero_stage=3)
    bigger = dataclasses.replace(s, device=dataclasses.replace(s.device, nccl_buffsize_mib=8.0))
    assert estimate(bigger).device_total_bytes - estimate(s).device_total_bytes == 2 * 96 * MiB
