"""A pipeline stage's backwards making gradients after the forward/backward cache was built
(harness/estimate/backward_cache.py): stage 0's whole embedding gradients without a data-parallel
wrapper (``embedding_grad``), and the first backward's gradients beside one micro-batch's freed blocks
(``first_backward``). Read from fake traces with CUDA's kernels at paper widths, cut to a few blocks."""

from __future__ import annotations

import pytest
from conftest import cut, in_fresh_process

from harness.alloc.allocator import CachingAllocator
from harness.alloc.trace import replay
from harness.estimate import estimate
from harness.estimate.levels import reserved_terms


def _traced_events(s) -> list[dict]:
    from harness.runner.fake.trace import trace_rank

    return trace_rank(s, 0, keep_trace=True)["trace"]


def _opened_by(events: list[dict], size: int, *, before: list[dict] = ()) -> int:
    """Replayed: the bytes by which requests of exactly ``size`` raised the reserved level (after
    ``before``, replayed first and not counted)."""
    a, live, opened = CachingAllocator(), {}, 0
    for e in before:
        if e["action"] == "alloc" and e["size"]:
            live[e["addr"]] = a.malloc(e["size"], e.get("stream") or 0)
        elif e["action"] == "free_completed" and live.get(e["addr"]) is not None:
            a.free_block(live.pop(e["addr"]))
    for e in events:
        if e["action"] == "alloc" and e["size"]:
            before = a.reserved
            live[e["addr"]] = a.malloc(e["size"], e.get("stream") or 0)
            opened += (a.reserved - before) * (e["size"] == size)
        elif e["action"] == "free_completed" and live.get(e["addr"]) is not None:
            a.free_block(live.pop(e["addr"]))
    return opened


def _stage0(s):
    est = estimate(s)
    st = next(x for x in est.stages if x.stage == 0)
    terms = reserved_terms(s, st.terms, stage=0)
    level = st.total_bytes + sum(v for k, v in terms.items() if k != "cublas_workspace")
    return terms, level


def _spec(model: str, layers: int, **overrides):
    kw = {"train_precision": "bf16", "train_seq_len": 8192, "train_recompute": "none"}
    return cut(model, layers, "h100_80gb", **{**kw, **overrides})


def test_stage_0_without_a_wrapper_opens_a_segment_for_each_whole_embedding_gradient():
    """Llama-3-8B at 4 blocks, tp 2 × pp 2, one data rank (BF16 autocast), 2 micro-batches: the first
    backward's whole 2,004 MiB FP32 embedding gradient (v·h on each tp rank) and the second's, made
    before it is added to the first, open a segment each (no activation block is as large): traced
    2 × 2,004 MiB. At this cut the second backward's candidate is the allocated peak and holds 0.79 GiB
    of them (``grad_reduce``); the rest is the term. The engine's reserved level of stage 0 is 3.2 %
    under the replayed peak (14.13 against 14.60 GiB), 25 % under without the term. With a
    data rank more (``replicate``) its gradients are whole in BF16 and reduced: not this term."""
    s = _spec("llama3_8b", 4, parallel_tp=2, parallel_pp=2, train_num_microbatches=2)
    whole = 4 * s.model.vocab_size * s.model.hidden_size
    events = in_fresh_process(_traced_events, s)
    assert _opened_by(events, whole) == 2 * whole
    terms, level = _stage0(s)
    replayed = replay(events).peak_reserved_bytes
    assert terms["embedding_grad"] > whole
    assert level == pytest.approx(replayed, rel=0.04)
    assert level - terms["embedding_grad"] < 0.8 * replayed
    wrapped = _spec("llama3_8b", 4, parallel_tp=2, parallel_pp=2, parallel_dp=2, train_num_microbatches=2)
    assert _stage0(wrapped)[0]["embedding_grad"] == 0


def test_replicate_first_backward_gradients_open_segments_beside_the_freed_blocks():
    """Llama-2-70B at 4 blocks, tp 4 × pp 2 × dp 2 (``replicate``), s 4096, 2 micro-batches: stage 0's
    first backward makes its 224 MiB FP32 SwiGLU gradients while the freed blocks are one micro-batch's
    56-64 MiB tensors, and the whole embedding gradients (1,000 MiB FP32, 500 MiB BF16): each opens a
    segment. The engine's reserved level of stage 0 is 2.7 % under the replayed reserved peak (12.94
    against 13.30 GiB: the backward's own working set, not counted, takes some freed blocks), 7.6 %
    under without ``first_backward``."""
    s = _spec(
        "llama2_70b",
        4,
        parallel_tp=4,
        parallel_pp=2,
        parallel_dp=2,
        train_seq_len=4096,
        train_num_microbatches=2,
    )
    terms, level = _stage0(s)
    replayed = replay(in_fresh_process(_traced_events, s)).peak_reserved_bytes
    assert terms["first_backward"] > 0
    assert level == pytest.approx(replayed, rel=0.04)
    assert level - terms["first_backward"] < 0.94 * replayed


def _step_opened(events: list[dict], size: int, last: int) -> int:
    """Replayed: the bytes by which the last ``last`` requests of exactly ``size`` (the optimizer step's
    temporaries of that size) raised the reserved level."""
    first = [i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == size][-last]
    return _opened_by(events[first:], size, before=events[:first])


def test_recomputing_every_second_block_leaves_whole_layers_for_the_step():
    """Llama-2-13B tp 4 × pp 2, full recomputation of every 2nd block, 8 micro-batches (an extended grid
    point, cut to 20 blocks), stage 0: the blocks not recomputed keep every tensor, so at the peak the
    activations sit in 80 and 54 MiB blocks (at 40 blocks a hundred and seventy-nine), free when the
    step starts, and the step's 68 MiB FP32 temporaries open no segment. The engine's cache at the step
    holds those blocks: no step segment, where the checkpointed inputs' sizes alone gave 1.27 GiB here
    (3.5 GiB at 40 blocks)."""
    s = _spec(
        "llama2_13b",
        20,
        parallel_tp=4,
        parallel_pp=2,
        train_recompute="full",
        train_recompute_every=2,
        train_num_microbatches=8,
    )
    terms, _ = _stage0(s)
    temporary = 4 * s.model.hidden_size * s.model.ffn_hidden_size // 4
    assert _step_opened(in_fresh_process(_traced_events, s), temporary, 3 * 10) == 0
    assert terms["optimizer_step_segments"] == 0
