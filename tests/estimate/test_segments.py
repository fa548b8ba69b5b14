"""The reserved level's mechanism terms (harness/estimate/segments.py) against the fake traces of
paper-scale points that found them (replayed through harness/alloc; the figures are the segment sizes
the replay opened), and the allocator rules they apply."""

from __future__ import annotations

from conftest import spec

from harness.estimate import estimate
from harness.estimate.levels import reserved_terms, reserved_upper_bound
from harness.estimate.loss_cache import (
    fsdp_embedding_grad_segment,
    fsdp_root_segments,
    loss_logits_segment,
    op_packing_segments,
    recompute_packing_segments,
    recompute_working_set_segments,
)
from harness.estimate.placement import place
from harness.estimate.segments import reduce_stream_segments, segment_terms

MiB = 1 << 20
BF16_PP = {
    "train_seq_len": 8192,
    "train_micro_batch_size": 1,
    "train_num_microbatches": 8,
    "train_precision": "bf16",
}


def test_replicate_keeps_each_units_fp32_buffer_on_the_reduce_stream():
    # Llama-2-13B tp 2 x pp 2 x dp 2 (replicate), stage 0, traced: twenty 605 MiB segments (one per
    # layer: 158.6 M parameters x 4 B, rounded to 2 MiB) and one of 314 MiB (the embedding) on stream 2.
    s = spec("llama2_13b", "h100_94gb", parallel_dp=2, parallel_tp=2, parallel_pp=2, **BF16_PP)
    assert reduce_stream_segments(s, 0) == 20 * 635437056 + 329252864


def test_fsdp2_keeps_each_units_fp32_shard_on_the_reduce_stream():
    # torchtitan's defaults, Llama-3-8B dp 8 ZeRO-3 (kept head), traced: 32 segments of 106 MiB (a
    # layer's FP32 shard) and two of 252 MiB (the embedding's, the head's) on stream 2.
    s = spec(
        "llama3_8b",
        "h100_80gb",
        parallel_dp=8,
        parallel_zero_stage=3,
        parallel_fsdp_reshard_after_forward="default",
        train_seq_len=8192,
        train_precision="bf16",
        train_recompute="op",
        train_grad_sync="every_microbatch",
    )
    assert reduce_stream_segments(s, 0) == 32 * 111149056 + 2 * 264241152
    assert estimate(s).reserved_terms()["reduce_stream"] == 32 * 111149056 + 2 * 264241152


def test_fsdp2_leaves_the_root_units_blocks_cached_at_the_loss():
    # Llama-3-8B dp 8 ZeRO-3 resharding after forward, s 8192, selective, traced: at the reserved peak
    # a 2,006 MiB segment on stream 1 (the root's all-gather output: embedding, final norm and head in
    # BF16), two of 1,002 MiB (the vocabulary matrices copied out of it) and one of 4,008 MiB opened at
    # the end of backward (the root's FP32 reduce-scatter input), all free. The rule rounds the input,
    # which holds the final norm too, to 4,010 MiB.
    s = spec(
        "llama3_8b",
        "h100_80gb",
        parallel_dp=8,
        parallel_zero_stage=3,
        parallel_fsdp_reshard_after_forward="always",
        train_recompute="selective",
        **BF16_PP,
    )
    # (on stream 1 besides: the root's 252 MiB all-gather input and a layer's 418 MiB output, free too)
    assert fsdp_root_segments(s, 0) == (2006 + 2 * 1002 + 4010 + 252 + 418) * MiB
    est = estimate(s)
    assert est.reserved_terms()["fsdp_root"] == fsdp_root_segments(s, 0)
    # the replayed reserved peak of that trace: 109.08 GiB; the engine's level within 3 % under it
    assert 0.97 * 109.08 * 2**30 < est.reserved_total_bytes < 109.08 * 2**30
    # not where the peak holds the root, or nothing is sharded
    for other in ({"parallel_dp": 1}, {"parallel_zero_stage": 1}):
        assert fsdp_root_segments(spec("llama3_8b", "h100_80gb", **{**_SPEC_8B_Z3, **other}), 0) == 0
    piped = spec("llama3_8b", "h100_80gb", **{**_SPEC_8B_Z3, "parallel_pp": 2, "parallel_dp": 4})
    assert fsdp_root_segments(piped, 0) == 0 and fsdp_root_segments(piped, 1) > 0


# Traced (run.mode=fake, rank 0's step replayed) for issue 32: Llama-3-8B dp 8 ZeRO-3, s 8192, BF16,
# one micro-batch of 2, on the paper's H100 (torchtitan's published run of this layout reserved 82.4 GiB).
# (policy, recompute): (the root's cached blocks and opened segment in MiB, the loss's cached logits in
# MiB, the replayed reserved peak in GiB)
_TRACED_MB2 = {
    # all-gather outputs of the embedding (1,002) and of the head with the norm (1,004, too large for
    # the embedding's segment) on stream 1, the head's copy alive,
    # the embedding's copy on stream 0; on stream 1 too, the head's 126 MiB all-gather input and a
    # layer's 418 MiB all-gather output
    ("default", "op"): (1002 + 1004 + 1002 + 126 + 418, 4008, 81.79),
    # the root's all-gather output and its two copies; its 4,010 MiB reduce-scatter input is served by
    # the loss's cached 8,016 MiB blocks at the end of backward
    ("always", "op"): (2006 + 2 * 1002 + 252 + 418, 4008, 81.91),
}


def test_the_root_units_and_the_losss_cached_blocks_under_both_fsdp2_policies():
    for (policy, recompute), (root_mib, logits_mib, replayed_gib) in _TRACED_MB2.items():
        s = spec(
            "llama3_8b",
            "h100_94gb",
            parallel_dp=8,
            parallel_zero_stage=3,
            parallel_fsdp_reshard_after_forward=policy,
            train_recompute=recompute,
            train_seq_len=8192,
            train_micro_batch_size=2,
            train_precision="bf16",
        )
        assert fsdp_root_segments(s, 0) == root_mib * MiB, policy
        assert loss_logits_segment(s, 0) == logits_mib * MiB, policy
        terms = estimate(s).reserved_terms()
        assert (terms["fsdp_root"], terms["loss_logits"]) == (root_mib * MiB, logits_mib * MiB)
        # what is left between the engine and the replay: the forward's freed blocks that its later
        # tensors did not take (docs/gpu-memory.md)
        assert 0.95 * replayed_gib * 2**30 < estimate(s).reserved_total_bytes < replayed_gib * 2**30, policy


def test_the_losss_cached_logits_only_in_a_compute_dtype_narrower_than_its_fp32_buffers():
    base = {"train_seq_len": 8192, "train_micro_batch_size": 1, "parallel_dp": 8, "parallel_zero_stage": 1}
    # any data parallelism: the block is the loss's, not FSDP2's (2 B x 8192 x 128,256 = 2,004 MiB)
    assert (
        loss_logits_segment(spec("llama3_8b", "h100_80gb", train_precision="bf16", **base), 0) == 2004 * MiB
    )
    assert loss_logits_segment(spec("llama3_8b", "h100_80gb", train_precision="fp32", **base), 0) == 0
    piped = spec(
        "llama3_8b", "h100_80gb", train_precision="bf16", **{**base, "parallel_pp": 2, "parallel_dp": 4}
    )
    assert loss_logits_segment(piped, 0) == 0  # (not the last stage)


# The last stage's rank of fake traces (harness stack, BF16, s 8192, 8 micro-batches, no recomputation)
# replayed: its reserved peak and allocated peak (GiB), python scripts/segment_openings.py
_TRACED_PIPELINES = {
    # (tp, pp, dp, micro-batch): (replayed reserved, allocated)
    (4, 2, 1, 4): (136.42, 113.71),
    (1, 8, 1, 4): (119.14, 108.55),
}


def test_the_pipelined_last_stages_loss_blocks_carved_by_the_next_forward():
    """Under a pipeline the loss's gathered logits copy is freed before the upcast (C, tp > 1), and
    under 1F1B the next micro-batch's forward carves the loss's freed C blocks, so its loss opens a new
    FP32 block: 3·C free at the peak with tensor parallelism, C without; interleaved, C (tp > 1)."""
    for (tp, pp, dp, mbs), (reserved_gib, allocated_gib) in _TRACED_PIPELINES.items():
        kw = {"parallel_tp": tp, "parallel_pp": pp, "parallel_dp": dp, "parallel_sequence_parallel": tp > 1}
        s = spec(
            "llama3_8b",
            "h100_94gb",
            train_seq_len=8192,
            train_micro_batch_size=mbs,
            train_num_microbatches=8,
            train_precision="bf16",
            train_recompute="none",
            train_grad_sync="last",
            parallel_fsdp_reshard_after_forward="always",
            **kw,
        )
        c = 2 * 8192 * mbs * 128256  # one block of full-vocabulary logits in BF16 (gathered under pp)
        assert loss_logits_segment(s, pp - 1) == (3 * c if tp > 1 else c)
        est = estimate(s)
        last = est.stages[-1]
        assert abs(last.total_bytes / 2**30 - allocated_gib) / allocated_gib < 0.01
        level = (
            last.total_bytes
            + sum(est.reserved_terms(last).values())
            - est.reserved_terms(last)["cublas_workspace"]
        )
        assert abs(level / 2**30 - reserved_gib) / reserved_gib < 0.03, (tp, pp, level / 2**30)
    inter = spec(
        "llama3_8b",
        "h100_94gb",
        train_seq_len=8192,
        train_micro_batch_size=1,
        train_num_microbatches=8,
        train_precision="bf16",
        parallel_tp=2,
        parallel_pp=2,
        parallel_dp=2,
        parallel_sequence_parallel=True,
        parallel_pp_schedule="interleaved_1f1b",
        parallel_virtual_stages=2,
    )
    assert loss_logits_segment(inter, 1) == 2 * 8192 * 128256
    fp32 = spec(
        "llama3_8b",
        "h100_94gb",
        train_seq_len=8192,
        train_precision="fp32",
        parallel_tp=2,
        parallel_pp=2,
        train_num_microbatches=8,
    )
    assert loss_logits_segment(fp32, 1) == 0


def test_full_recomputation_packs_the_saved_inputs_into_freed_swiglu_blocks():
    # torchtitan's stack, Llama-3-8B dp 8 ZeRO-3, s 8192, BF16, every block recomputed, traced (the
    # allocated peak of one rank's replayed step, python scripts/segment_openings.py): three inputs of
    # 256 / 512 / 768 MiB in each 896 / 1,792 / 2,688 MiB SwiGLU block, ten free remainders each.
    full = {"parallel_dp": 8, "parallel_zero_stage": 3, "train_seq_len": 8192, "train_precision": "bf16"}
    for mbs, remainder in ((4, 128), (8, 256), (12, 384)):
        s = spec("llama3_8b", "h100_94gb", train_recompute="full", train_micro_batch_size=mbs, **full)
        assert recompute_packing_segments(s, 0) == 10 * remainder * MiB, mbs
        assert estimate(s).reserved_terms()["recompute_packing"] == 10 * remainder * MiB, mbs
    # Llama-2-13B at micro-batch 6: two 480 MiB inputs per 1,296 MiB block; traced eighteen remainders of
    # 336 MiB and one of 86 MiB, where the rule counts nineteen of 336 ((40 - 1) // 2)
    s = spec("llama2_13b", "h100_94gb", train_recompute="full", train_micro_batch_size=6, **full)
    assert recompute_packing_segments(s, 0) == 19 * 336 * MiB
    # blocks that keep their SwiGLU tensors take the freed ones whole: no packing
    for other in ({"train_recompute": "op"}, {"train_recompute": "none"}, {"train_recompute_every": 2}):
        kw = {"train_recompute": "full", "train_micro_batch_size": 4, **full, **other}
        assert recompute_packing_segments(spec("llama3_8b", "h100_94gb", **kw), 0) == 0, other
    # tp 2 without sequence parallelism, traced: one whole input (256 MiB) per half SwiGLU block (448 MiB),
    # twenty-nine remainders of 192 MiB, where the rule counts thirty-one
    s = spec(
        "llama3_8b",
        "h100_94gb",
        train_recompute="full",
        train_micro_batch_size=4,
        parallel_tp=2,
        parallel_sequence_parallel=False,
        **{**full, "parallel_dp": 4},
    )
    assert recompute_packing_segments(s, 0) == 31 * (448 - 256) * MiB
    # with sequence parallelism the inputs fill the gathered inputs' blocks instead (traced on Llama-3-70B
    # tp 8: seven 64 MiB inputs per 512 MiB block): not this rule
    sp = dict(parallel_tp=2, parallel_sequence_parallel=True)
    s = spec("llama3_8b", "h100_94gb", train_recompute="full", train_micro_batch_size=4, **{**full, **sp})
    assert recompute_packing_segments(s, 0) == 0


def test_the_last_blocks_working_set_is_free_at_the_loss_but_for_the_losss_smaller_requests():
    # The same traces, at the allocated peak: three free SwiGLU blocks at micro-batch 4 (the kept head's
    # 1,002 MiB BF16 copy does not fit 896 MiB); at 8 two of 1,792 MiB and 790 beside the copy; at 12
    # one of 2,688, 1,686 beside the copy and 684 beside the chunked loss's 2,004 MiB FP32 head gradient.
    full = {"parallel_dp": 8, "parallel_zero_stage": 3, "train_seq_len": 8192, "train_precision": "bf16"}
    torchtitan = {"parallel_fsdp_reshard_after_forward": "default", "train_loss_chunks": 8, **full}
    copy, grad = 1002 * MiB + 8 * 1024, 2004 * MiB  # (the copy holds the final norm's weight too)
    for mbs, free in ((4, 3 * 896 * MiB), (8, 3 * 1792 * MiB - copy), (12, 3 * 2688 * MiB - copy - grad)):
        s = spec("llama3_8b", "h100_94gb", train_recompute="full", train_micro_batch_size=mbs, **torchtitan)
        est = estimate(s)
        assert est.reserved_terms()["recompute_working_set"] == free, mbs
        assert recompute_working_set_segments(s, 0, est.stages[0].terms) == free, mbs
    # this runner's stack (unchunked, root resharded): three free 896 MiB blocks at micro-batch 4
    s = spec("llama3_8b", "h100_94gb", train_recompute="full", train_micro_batch_size=4, **full)
    assert estimate(s).reserved_terms()["recompute_working_set"] == 3 * 896 * MiB
    # Llama-2-13B at micro-batch 6 peaks in the last block's MLP, before the loss: its working set in use
    s = spec("llama2_13b", "h100_94gb", train_recompute="full", train_micro_batch_size=6, **torchtitan)
    assert estimate(s).reserved_terms()["recompute_working_set"] == 0


_SPEC_8B_Z3 = {
    "parallel_dp": 8,
    "parallel_zero_stage": 3,
    "parallel_fsdp_reshard_after_forward": "always",
    "train_precision": "bf16",
}


def test_no_reduce_stream_where_gradients_live_in_ddp_buckets_or_are_not_reduced():
    assert (
        reduce_stream_segments(spec("llama3_8b", "h100_80gb", parallel_dp=8, parallel_zero_stage=1), 0) == 0
    )
    assert reduce_stream_segments(spec("llama3_8b", "h100_80gb", parallel_tp=4, parallel_pp=2), 0) == 0


def test_optimizer_step_opens_segments_where_no_cached_block_holds_its_temporaries():
    # Llama-2-13B tp 2 x pp 4, one data-parallel rank: the gradients stay, the 135 MiB FP32 temporaries
    # of the SwiGLU weights are larger than every activation block (s·b·f/t·2 = 108 MiB). Traced, stage
    # 0: 20 of its 30 open a 136 MiB segment. The model's cache lacks some of the blocks the trace had
    # (it opens 26); it must open at least what the trace did and at most all 30.
    s = spec("llama2_13b", "h100_94gb", parallel_tp=2, parallel_pp=4, **BF16_PP)
    opened = estimate(s).reserved_terms(estimate(s).stages[0])["optimizer_step_segments"]
    assert 20 * 136 * MiB <= opened <= 30 * 136 * MiB


def test_gradients_freed_before_the_step_hold_its_temporaries():
    # Llama-2-13B cp 4 x dp 2, ZeRO-1, 8 micro-batches: DDP's no_sync gradients are copied into its
    # buckets and freed by the last backward; traced, the step opens no segment.
    s = spec("llama2_13b", "h100_94gb", parallel_dp=2, parallel_cp=4, parallel_zero_stage=1, **BF16_PP)
    assert estimate(s).reserved_terms()["optimizer_step_segments"] == 0


def test_place_applies_best_fit_and_the_split_rule():
    blocks = ((30 * MiB, 1), (100 * MiB, 1))
    assert place(blocks, ((25 * MiB, 1),)) == 0  # best fit: the 30 MiB block, not the 100 MiB one
    assert place(blocks, ((25 * MiB, 2), (4 * MiB, 1))) == 0  # the 100 MiB block split; 5 MiB remainders
    assert place(blocks, ((120 * MiB + 1, 1),)) == 122 * MiB  # no block fits: a segment rounded to 2 MiB
    assert place(blocks, ((5 * MiB, 8),)) == 0  # the 30 MiB block holds six, split by split; 100 MiB the rest
    assert place((), ((3 * MiB, 2),)) == 20 * MiB  # below 10 MiB: one 20 MiB segment, shared
    assert place((), ((12 * MiB, 3),)) == 3 * 12 * MiB  # 10 MiB and above: a segment each
    assert place((), ((512 * 1024, 4),)) == 0  # the small pool is not this cache


def test_mechanism_terms_only_for_the_torch_engine_on_a_gpu():
    gpu = spec("llama2_13b", "h100_94gb", parallel_dp=2, parallel_tp=2, parallel_pp=2, **BF16_PP)
    for engine in ("megatron", "paper"):
        terms = estimate(gpu, engine=engine).reserved_terms()
        assert terms["reduce_stream"] == terms["optimizer_step_segments"] == 0
    cpu = spec("tiny", parallel_dp=2, parallel_pp=2, train_num_microbatches=2)
    assert sum(estimate(cpu).reserved_terms().values()) == 0


def test_reserved_level_sums_the_terms_and_the_pruned_search_finds_the_worst_stage():
    for overrides in (
        {"parallel_dp": 2, "parallel_tp": 2, "parallel_pp": 2},
        {"parallel_tp": 2, "parallel_pp": 4},
        {
            "parallel_tp": 4,
            "parallel_pp": 4,
            "parallel_dp": 2,
            "parallel_virtual_stages": 2,
            "parallel_pp_schedule": "interleaved_1f1b",
        },
        {"parallel_tp": 2, "parallel_pp": 8, "parallel_dp": 2, "parallel_zero_stage": 3},
    ):
        s = spec("llama2_13b", "h100_94gb", **overrides, **BF16_PP)
        est = estimate(s)
        levels = []
        for st in est.stages:
            terms = reserved_terms(s, st.terms, stage=st.stage, engine="torch")
            levels.append(st.total_bytes + sum(terms.values()))
            assert reserved_upper_bound(s, st.terms, stage=st.stage) >= levels[-1]
            assert sum(segment_terms(s, st.stage, st.terms).values()) >= 0
        assert est.reserved_total_bytes == max(levels)
        assert est.reserved_worst.stage == levels.index(max(levels))


def test_the_upper_bound_holds_on_every_stage_of_many_layouts():
    # The pruned search of the reserved worst stage (core.Estimate._reserved, profile.reserved_bytes)
    # is exact only if the bound is one; ZeRO-1 rounds its share up by whole tensors (the embedding).
    import itertools

    checked = 0
    for tp, pp, dp, zero in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 8), (0, 1, 2, 3)):
        s = spec(
            "llama3_8b",
            "h100_80gb",
            parallel_tp=tp,
            parallel_pp=pp,
            parallel_dp=dp,
            parallel_zero_stage=zero,
            train_num_microbatches=2 * pp,
            train_precision="bf16",
            train_seq_len=4096,
        )
        for st in estimate(s).stages:
            exact = st.total_bytes + sum(reserved_terms(s, st.terms, stage=st.stage).values())
            assert reserved_upper_bound(s, st.terms, stage=st.stage) >= exact, (tp, pp, dp, zero, st.stage)
            checked += 1
    assert checked > 150


def test_expert_parallel_tensors_and_units_are_sharded_over_the_ranks_that_hold_them():
    # Mixtral-8x7B, dp 8, ZeRO-3, ep 2: each rank holds 4 experts (3 matrices of 4096 × 14,336 each,
    # per layer), sharded over the 4 ranks that hold the same ones; the block's other matrices over 8.
    from harness.estimate.segments import _reduce_units, step_temporaries

    s = spec("mixtral_8x7b", "h100_80gb", parallel_dp=8, parallel_ep=2, parallel_zero_stage=3)
    expert = 4096 * 14336
    temporaries = dict(step_temporaries(s, 0))
    assert temporaries[4 * expert // 4] == 3 * 4 * 32  # FP32, one per expert matrix the rank steps
    assert (
        dict(step_temporaries(spec("mixtral_8x7b", "h100_80gb", parallel_dp=8, parallel_zero_stage=3), 0))[
            4 * expert // 8
        ]
        == 3 * 8 * 32
    )
    # The experts' reduce-scatter output: a unit of its own per block, 4 experts over 4 ranks.
    units = dict(_reduce_units(s.model, 1, 1, 0, 8, 3, 0, 2))
    assert units[4 * 3 * 4 * expert // 4] == 32


def test_op_recomputation_packs_the_kept_tensors_into_the_previous_blocks_freed_swiglu_blocks():
    # torchtitan's stack, Llama-3-8B dp 8 ZeRO-3, s 8192, micro-batch 2, traced at the loss's peak
    # (docs/gpu-memory.md): forty 448 MiB SwiGLU blocks hold the kept 128 MiB tensors three at a time
    # and the 32 MiB V tensors in some remainders; 13 x 128 = 1,664 MiB lost. The rule: 42 blocks of
    # 64 MiB remainders less 31 V tensors, 1,696 MiB.
    base = {
        "train_seq_len": 8192,
        "train_micro_batch_size": 2,
        "train_precision": "bf16",
        "train_recompute": "op",
    }
    fsdp = spec("llama3_8b", "h100_94gb", parallel_dp=8, parallel_zero_stage=3, **base)
    assert op_packing_segments(fsdp, 0) == 1696 * MiB
    assert estimate(fsdp).reserved_terms()["recompute_packing"] == 1696 * MiB
    # unchunked, the peak at the loss: two of the last block's three freed 448 MiB blocks still whole
    whole = spec("llama3_8b", "h100_94gb", parallel_dp=8, parallel_zero_stage=3, train_loss_chunks=1, **base)
    assert estimate(whole).reserved_terms()["recompute_working_set"] == 2 * 448 * MiB
    # tensor parallelism with SP, block by block in the forward's order (loss_cache._op_packing_in_order;
    # traced: 56 T blocks with 32 MiB free, 1.8 GiB): per block a 224 MiB T block takes three 64 MiB
    # tensors, another a 128 MiB partial sum and a 64, 32 MiB left in each, the 16 MiB V in some
    tp2 = spec("llama3_8b", "h100_94gb", parallel_dp=4, parallel_tp=2, parallel_zero_stage=3, **base)
    assert op_packing_segments(tp2, 0) == 1488 * MiB
    no_sp = spec(
        "llama3_8b",
        "h100_94gb",
        parallel_dp=4,
        parallel_tp=2,
        parallel_zero_stage=3,
        parallel_sequence_parallel=False,
        **base,
    )
    # not modelled: tp without SP, a pipeline, autocast's FP32 input (DDP / ZeRO-1)
    assert op_packing_segments(no_sp, 0) == 0
    assert (
        op_packing_segments(spec("llama3_8b", "h100_94gb", parallel_dp=8, parallel_zero_stage=1, **base), 0)
        == 0
    )
    piped = spec(
        "llama3_8b",
        "h100_94gb",
        parallel_dp=4,
        parallel_pp=2,
        parallel_zero_stage=1,
        train_num_microbatches=8,
        **base,
    )
    assert op_packing_segments(piped, 0) == op_packing_segments(piped, 1) == 0
    # without grouped-query attention V is as large as A and is packed with them (Llama-2-13B)
    mha = spec("llama2_13b", "h100_94gb", parallel_dp=8, parallel_zero_stage=3, **base)
    a, t = 160 * MiB, 432 * MiB  # s·b·h·2 and s·b·f·2
    blocks = -(-5 * 39 // (t // a))
    assert op_packing_segments(mha, 0) == blocks * (t - 2 * a)


def test_a_pipelines_first_stage_under_fsdp2_and_tp_opens_a_segment_for_the_whole_embedding_gradient():
    # torchtitan's stack, Llama-3-70B tp 8 x pp 4 x dp 2, s 8192, 8 micro-batches, stage 0 traced: the
    # second micro-batch's BF16 whole-vocabulary gradient (128,256 x 8,192 x 2 B = 2,004 MiB) opens a
    # segment after the allocated peak (the first's block is carved by later activations)
    base = {
        "train_seq_len": 8192,
        "train_num_microbatches": 8,
        "train_precision": "bf16",
        "parallel_zero_stage": 3,
    }
    s = spec("llama3_70b", "h100_94gb", parallel_tp=8, parallel_pp=4, parallel_dp=2, **base)
    assert fsdp_embedding_grad_segment(s, 0) == 2004 * MiB
    assert fsdp_embedding_grad_segment(s, 1) == 0
    assert estimate(s).reserved_terms(estimate(s).stages[0])["fsdp_root"] >= 2004 * MiB
    # not without tp (the gradient is the shard), without FSDP2 or without a pipeline
    assert (
        fsdp_embedding_grad_segment(spec("llama3_70b", "h100_94gb", parallel_pp=4, parallel_dp=16, **base), 0)
        == 0
    )
    ddp = {**base, "parallel_zero_stage": 0}
    assert (
        fsdp_embedding_grad_segment(
            spec("llama3_70b", "h100_94gb", parallel_tp=8, parallel_pp=4, parallel_dp=2, **ddp), 0
        )
        == 0
    )
    assert (
        fsdp_embedding_grad_segment(spec("llama3_70b", "h100_94gb", parallel_tp=8, parallel_dp=8, **base), 0)
        == 0
    )
