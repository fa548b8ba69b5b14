"""Gradient accumulation's FP32 gradients carved out of freed activation blocks
(harness/estimate/loss_cache.py ``accumulated_grad_segments``): the bytes left free beside them at a
later micro-batch's peak, read from fake traces with CUDA's kernels at paper widths, cut to a few blocks."""

from __future__ import annotations

import pytest
from conftest import cut, in_fresh_process

from harness.alloc.allocator import CachingAllocator
from harness.estimate import estimate
from harness.estimate.levels import reserved_terms

MIB = 1 << 20


def _traced_events(s) -> list[dict]:
    from harness.runner.fake.trace import trace_rank

    return trace_rank(s, 0, keep_trace=True)["trace"]


def _free_beside(events: list[dict], sizes: set[int]) -> int:
    """Replayed to the allocated peak: the free bytes in the segments that hold a block requested with
    one of ``sizes`` (the FP32 gradients of the layers' matrices)."""
    a, live, peak = CachingAllocator(), {}, (0, 0)
    for i, e in enumerate(events):  # the event at which the allocated level peaks
        if e["action"] == "alloc" and e["size"]:
            live[e["addr"]] = a.malloc(e["size"], e.get("stream") or 0)
            peak = max(peak, (a.allocated, -i))
        elif e["action"] == "free_completed" and live.get(e["addr"]) is not None:
            a.free_block(live.pop(e["addr"]))
    a, live = CachingAllocator(), {}
    for e in events[: -peak[1] + 1]:
        if e["action"] == "alloc" and e["size"]:
            live[e["addr"]] = a.malloc(e["size"], e.get("stream") or 0)
        elif e["action"] == "free_completed" and live.get(e["addr"]) is not None:
            a.free_block(live.pop(e["addr"]))
    segments = {id(b.segment): b.segment for b in live.values() if b.requested in sizes}
    return sum(b.size for seg in segments.values() for b in seg.blocks() if not b.allocated)


def _gradient_sizes(s) -> set[int]:
    m, tp = s.model, s.parallel.tp
    h = m.hidden_size
    sizes = {4 * h * w // tp for w in (m.q_width, m.kv_width, m.ffn_hidden_size)}
    return {n for n in sizes if n >= 10 * MIB}  # the smaller ones share 20 MiB segments


def _spec(model: str, layers: int, **overrides):
    kw = {
        "train_precision": "bf16",
        "train_seq_len": 8192,
        "train_grad_sync": "last",
        "train_num_microbatches": 3,
        "parallel_fsdp_reshard_after_forward": "always",
    }
    return cut(model, layers, "h100_80gb", **{**kw, **overrides})


def _term(s) -> int:
    st = estimate(s).worst
    return reserved_terms(s, st.terms, stage=st.stage)["grad_accumulation"]


def test_ddp_no_sync_gradients_leave_the_remainders_of_the_activation_blocks_they_split():
    """Llama-2-13B at 4 blocks, tp 2 × dp 4, ZeRO-1 (DDP under ``no_sync``, BF16 autocast), 3
    micro-batches: each block's three 135 MiB FP32 SwiGLU gradients split a 160 MiB FP32 residual
    block, its four 50 MiB attention ones an 80 MiB BF16 one. Traced: 484 MiB free beside them at
    the peak; the engine 480 MiB. Reduced after every micro-batch, nothing accumulates: 0."""
    s = _spec("llama2_13b", 4, parallel_tp=2, parallel_dp=4, parallel_zero_stage=1)
    term = _term(s)
    assert term > 0
    assert term == pytest.approx(
        _free_beside(in_fresh_process(_traced_events, s), _gradient_sizes(s)), rel=0.05
    )
    every = _spec(
        "llama2_13b",
        4,
        parallel_tp=2,
        parallel_dp=4,
        parallel_zero_stage=1,
        train_grad_sync="every_microbatch",
    )
    assert _term(every) == 0


@pytest.mark.slow  # two traces of 8 and 16 blocks, about 20 s
def test_fsdp2_unsharded_gradients_per_block_under_full_recomputation():
    """Llama-3-70B, tp 8 × dp 8, ZeRO-3 accumulating unsharded FP32 gradients, full recomputation, 3
    micro-batches. The engine: two of a block's three 112 MiB SwiGLU gradients split its two
    recomputed 128 MiB gathered inputs (the third opens a segment), its two 32 MiB attention ones
    56 MiB SwiGLU blocks, 80 MiB a block. Traced at 80 blocks: 227 of the 240 in 128 MiB blocks (the
    gathered inputs' gradients are of that size too), 76 of those remainders refilled by the next
    micro-batches' 16 MiB inputs, 138 of the 160 in 56 MiB blocks; 6.04 GiB free beside them, the
    engine 6.25 GiB. Here per block (16 blocks less 8, which cancels what the first backward's
    earliest gradients do): traced 724 MiB for 8 blocks, the engine 640 MiB."""
    small, large = (
        _spec("llama3_70b", n, parallel_tp=8, parallel_dp=8, parallel_zero_stage=3, train_recompute="full")
        for n in (8, 16)
    )
    sizes = _gradient_sizes(small)
    traced = [_free_beside(in_fresh_process(_traced_events, s), sizes) for s in (small, large)]
    engine = [_term(s) for s in (small, large)]
    assert engine[1] - engine[0] == 8 * (2 * 16 + 2 * 24) * MIB
    assert engine[1] - engine[0] == pytest.approx(traced[1] - traced[0], rel=0.15)


def test_pipeline_stage_gradients_leave_remainders_in_one_micro_batchs_blocks():
    """Under a pipeline the first backward frees one micro-batch's activations of the stage's blocks,
    and its FP32 gradients split them as without one; the next forwards refill what they can (1F1B's
    steady state). Llama-2-13B at 8 blocks, tp 2 × pp 2 (one data rank, BF16 autocast), 4
    micro-batches, stage 0 (4 blocks): traced 730 MiB free beside the gradients at the peak, the
    engine 480 MiB (at 4 blocks 340 and 240: what it counts grows with the blocks as the trace's
    does). The stage's reserved level 3.1 % under the replay with the term, 5.0 % without."""
    s = _spec("llama2_13b", 8, parallel_tp=2, parallel_pp=2, train_num_microbatches=4, train_grad_sync="last")
    st = next(x for x in estimate(s).stages if x.stage == 0)
    term = reserved_terms(s, st.terms, stage=0)["grad_accumulation"]
    traced = _free_beside(in_fresh_process(_traced_events, s), _gradient_sizes(s))
    assert 0.5 * traced < term <= traced
