"""BF16 against the torch engine (issue 30 item 2): the mechanisms the BF16 CPU study found, each named
by the tensors torch saves, and the real runs that read 6-16 % above the engine before.

- SDPA's math path computes BF16 in FP32 (act.math_attention_bytes);
- under tp, loss_parallel keeps the FP32 upcast of the logits in place of the BF16 ones (act.logits);
- on the CPU, the composite ``F.rms_norm`` keeps FP32 tensors for BF16 input (dtypes.norm_elem_bytes),
  which autocast hid and FSDP2's BF16 parameters (no autocast) showed;
- the rotary tables cast to BF16 in every layer (act.rope_table_bytes).

and every stage of a pipeline (issue 30 item 3): what 1F1B keeps of what it sent
(pipeline.one_f_one_b_sends_kept), the receive buffer a stage's first block saves and pp_p2p counts
too (pipe.received_input_saved), the runner's per-layer rotary tables (states.rotary_tables), the casts
a checkpointed block leaves to autocast's cache (act.checkpointed_casts) and the forward's end under
sequence parallelism (peaks.sequence_parallel_forward_end).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from conftest import fast_few, in_fresh_process, spec, stage_peaks

from harness.estimate import estimate
from harness.runner.supervisor import run_point


def _saved(fn) -> collections.Counter:
    """(shape, dtype) of every distinct storage autograd saves while ``fn`` runs, parameters aside."""
    seen = {}

    def pack(t):
        if not (t.grad_fn is None and t.requires_grad):
            seen.setdefault(t.untyped_storage().data_ptr(), (tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return collections.Counter(seen.values())


def _bf16_saved_tensors() -> tuple[list, int, int]:
    q, k, v = (torch.randn(1, 4, 64, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        math = _saved(lambda: F.scaled_dot_product_attention(q * 1, k * 1, v * 1, is_causal=True))
    x = torch.randn(1, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)
    norm = _saved(lambda: F.rms_norm(x * 1, (32,), w, 1e-5))

    from harness.runner.model import Attention

    s = spec("tiny", train_seq_len=64)
    att = Attention(s.model, 64, "flash")
    x = torch.randn(1, 64, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = _saved(lambda: att(x * 1))
    return (
        [str(dtype) for _, dtype in math],
        norm[((1, 64, 32), torch.float32)],
        saved[((64, 32), torch.bfloat16)],
    )


def test_torch_saves_what_the_engine_counts_for_bf16():
    # (in a process of its own: torch work here would leave threads behind for the runs that fork)
    math, norm, rope = in_fresh_process(_bf16_saved_tensors)
    assert math and set(math) == {"torch.float32"}  # Q, K, V and the softmax, upcast from BF16
    assert norm == 2  # the upcast input and the normalised output, in FP32
    assert rope == 2  # cos and sin, cast in this layer's forward


BF16_POINTS = {
    # measured/engine before issue 30's BF16 fixes: 1.15, 1.08, 1.07
    "math": dict(train_attention="math"),
    "tp2": dict(parallel_tp=2),
    "dp2-zero3": dict(parallel_dp=2, parallel_zero_stage=3),
    # FSDP2 without resharding keeps the embedding's whole FP32 gradient too
    # (stage.fsdp_replicated_embedding_grad): measured 2.7 % above the engine before ZeRO-2 counted it
    "tp2-dp2-zero2-m2": dict(parallel_tp=2, parallel_dp=2, parallel_zero_stage=2, train_num_microbatches=2),
}


@pytest.mark.parametrize("name", BF16_POINTS)
def test_bf16_runs_measure_within_2_percent_above_the_engine(name):
    s = spec("tiny", train_precision="bf16", train_seq_len=512, **BF16_POINTS[name])
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    engine = estimate(s).total_bytes
    # Over by up to 1 % is on the safe side (tp 2: 0.6 % since the rotary tables are counted).
    assert 0.99 * engine <= real["peak_allocated_bytes"] <= 1.02 * engine, (
        name,
        real["peak_allocated_bytes"],
        engine,
    )


STAGE_POINTS = {
    # Each rank's peak against its stage's estimate, before these mechanisms were modelled (stage by
    # stage, engine vs measured): -1.4/+1.3/-2.0/-0.3 %, -1.9/-0.9 %, +1.9 %, +1.7 %, -2.8/-0.6 %.
    "pp4-m4": dict(parallel_pp=4, train_num_microbatches=4),
    "pp2-dp2-m4": dict(parallel_pp=2, parallel_dp=2, train_num_microbatches=4),
    "full": dict(train_recompute="full"),
    "op": dict(train_recompute="op"),
    "tp2-sp-pp2-dp2": dict(parallel_tp=2, parallel_pp=2, parallel_dp=2, train_num_microbatches=2),
}


@pytest.mark.parametrize("name", fast_few(STAGE_POINTS, {"pp4-m4", "full"}))
def test_bf16_every_stage_measures_within_1_2_percent_above_its_estimate(name):
    s = spec("tiny", train_precision="bf16", train_seq_len=512, **STAGE_POINTS[name])
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    for stage, measured, estimated in stage_peaks(s, real):
        assert 0.99 * estimated <= measured <= 1.012 * estimated, (name, stage, measured, estimated)


def test_fsdp_pipeline_stage_0_peaks_at_its_first_backward():
    # tp 2 × pp 2 × cp 2, ZeRO-3: stage 0's peak is the end of its first backward, the embedding's
    # whole gradient in BF16 and its FP32 accumulated copy beside the unsharded FP32 block gradients
    # and the second micro-batch's activations (peaks.fsdp_pipeline_first_backward). Measured/engine:
    # 1.072 before, 1.023 with it; the rest (two 256 KiB blocks) is not named yet.
    s = spec(
        "tiny",
        train_precision="bf16",
        train_seq_len=512,
        parallel_tp=2,
        parallel_pp=2,
        parallel_cp=2,
        parallel_zero_stage=3,
        train_num_microbatches=2,
    )
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    (_, measured, estimated), *_ = stage_peaks(s, real)
    assert estimated <= measured <= 1.03 * estimated, (measured, estimated)
