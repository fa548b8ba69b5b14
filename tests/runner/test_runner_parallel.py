"""Correctness of the parallel runner, the way the field checks it: the losses of every parallel layout
equal a single-rank reference on the same global batch and seed.

Tolerance: relative 2e-4 on every step's loss (FP32; reduction order, the masked attention kernel of
context parallelism and gradient bucketing differ from the reference). The optimizer is made sensitive
to the gradient's scale for these tests: AdamW's first step is lr·g/(|g| + eps), which with the default
eps is lr·sign(g) and would hide a wrong averaging factor; with eps = 1 and lr = 2 the step is ~2·g,
so the losses after it check the gradient itself, not only its sign. (lr = 20, used before the model was
built on the meta device with name-keyed initial weights, overshoots: whether the first step lowered
the loss then depended on the initial values drawn, 8.36 -> 8.57 with the new ones; at lr = 2 it falls
by 0.25-0.30 tied and untied.) A wrong gradient averaging (sum instead of mean over 2 ranks, emulated
by lr 4) moves the step-2 loss well beyond the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import fast_few, spec

from harness.runner.parallel import compose
from harness.runner.supervisor import run_point
from harness.spec import canonical

GLOBAL_BATCH = 4
RTOL = 2e-4
COMMON = dict(train_precision="fp32", train_steps=3, train_seq_len=64)


@pytest.fixture(autouse=True)
def gradient_sensitive_adam(monkeypatch):
    monkeypatch.setattr(compose, "ADAM_EPS", 1.0)
    monkeypatch.setattr(compose, "LEARNING_RATE", 2.0)


def run(*, tied: bool = False, bias: bool = False, **kw) -> dict:
    s = spec("tiny", **COMMON, **kw)
    if tied or bias:
        model = dataclasses.replace(s.model, tie_embeddings=tied, qkv_bias=bias)
        s = canonical(dataclasses.replace(s, model=model))
    record = run_point(s, timeout_s=240)
    assert record["status"] == "ok", record["error"]
    return record


def _reference(*, tied: bool, bias: bool = False) -> list[float]:
    mp = pytest.MonkeyPatch()
    mp.setattr(compose, "ADAM_EPS", 1.0)
    mp.setattr(compose, "LEARNING_RATE", 2.0)
    try:
        one = dict(train_micro_batch_size=GLOBAL_BATCH, train_num_microbatches=1)
        losses = run(tied=tied, bias=bias, **one)["losses"]
    finally:
        mp.undo()
    # The steps must actually train, or equal losses would prove nothing.
    assert losses[1] < losses[0] - 0.05
    return losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _reference(tied=False)


@pytest.fixture(scope="module")
def tied_reference() -> list[float]:
    return _reference(tied=True)


def assert_same(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    for got, want in zip(losses, reference, strict=True):
        assert got == pytest.approx(want, rel=RTOL), (losses, reference)


LAYOUTS = {
    # one axis at a time (2 ranks)
    "dp2-zero0": dict(parallel_dp=2, train_micro_batch_size=2),
    "dp2-zero1": dict(parallel_dp=2, parallel_zero_stage=1, train_micro_batch_size=2),
    "dp2-zero2": dict(parallel_dp=2, parallel_zero_stage=2, train_micro_batch_size=2),
    "dp2-zero3": dict(parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2),
    "tp2-sp": dict(parallel_tp=2, train_micro_batch_size=4),
    "tp2-nosp": dict(parallel_tp=2, parallel_sequence_parallel=False, train_micro_batch_size=4),
    "cp2-balanced": dict(parallel_cp=2, train_micro_batch_size=4),
    "cp2-contiguous": dict(parallel_cp=2, parallel_cp_load_balance=False, train_micro_batch_size=4),
    "pp2-1f1b": dict(parallel_pp=2, train_micro_batch_size=2, train_num_microbatches=2),
    "pp2-gpipe": dict(
        parallel_pp=2, parallel_pp_schedule="gpipe", train_micro_batch_size=2, train_num_microbatches=2
    ),
    "pp2-interleaved": dict(
        parallel_pp=2,
        parallel_pp_schedule="interleaved_1f1b",
        parallel_virtual_stages=2,
        train_micro_batch_size=2,
        train_num_microbatches=2,
    ),
    # uneven stages (parallel.pp_layers, issue 31): each stage runs its own blocks
    "pp2-uneven": dict(
        parallel_pp=2, parallel_pp_layers=(1, 3), train_micro_batch_size=2, train_num_microbatches=2
    ),
    "pp3-uneven": dict(
        parallel_pp=3, parallel_pp_layers=(1, 2, 1), train_micro_batch_size=1, train_num_microbatches=4
    ),
    # gradient accumulation and recomputation on one rank
    "accumulate4": dict(train_micro_batch_size=1, train_num_microbatches=4),
    "recompute-full": dict(train_micro_batch_size=4, train_recompute="full"),
    "recompute-selective": dict(train_micro_batch_size=4, train_recompute="selective"),
    # issue 15: torchtitan's checkpointing modes and the math kernel, alone and under parallelism
    "recompute-op": dict(train_micro_batch_size=4, train_recompute="op"),
    "recompute-full-every2": dict(train_micro_batch_size=4, train_recompute="full", train_recompute_every=2),
    # Megatron's --recompute-method uniform|block --recompute-num-layers 2, alone and under FSDP2
    "recompute-full-uniform2": dict(
        train_micro_batch_size=4,
        train_recompute="full",
        train_recompute_every=2,
        train_recompute_method="uniform",
    ),
    "recompute-full-block2": dict(
        train_micro_batch_size=4,
        train_recompute="full",
        train_recompute_every=2,
        train_recompute_method="block",
    ),
    "dp2-zero3-recompute-uniform2": dict(
        parallel_dp=2,
        parallel_zero_stage=3,
        train_micro_batch_size=2,
        train_recompute="full",
        train_recompute_every=2,
        train_recompute_method="uniform",
    ),
    "attention-math": dict(train_micro_batch_size=4, train_attention="math"),
    "tp2-recompute-op": dict(parallel_tp=2, train_micro_batch_size=4, train_recompute="op"),
    "cp2-math": dict(parallel_cp=2, train_micro_batch_size=4, train_attention="math"),
    "dp2-zero3-recompute-op": dict(
        parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2, train_recompute="op"
    ),
    # train.grad_sync=every_microbatch: reduced after each micro-batch (torchtitan's choice, issue 28)
    "dp2-zero0-every-microbatch": dict(
        parallel_dp=2, train_micro_batch_size=1, train_num_microbatches=2, train_grad_sync="every_microbatch"
    ),
    "dp2-zero3-every-microbatch": dict(
        parallel_dp=2,
        parallel_zero_stage=3,
        train_micro_batch_size=1,
        train_num_microbatches=2,
        train_grad_sync="every_microbatch",
    ),
    # torchtitan's defaults (stack=torchtitan, issue 28): the final norm and head a unit of their own
    # kept unsharded after forward, reduce-scatter after every micro-batch, per-op recomputation
    "dp2-zero3-torchtitan": dict(
        parallel_dp=2,
        parallel_zero_stage=3,
        parallel_fsdp_reshard_after_forward="default",
        train_micro_batch_size=1,
        train_num_microbatches=2,
        train_grad_sync="every_microbatch",
        train_recompute="op",
    ),
    # combinations (4 ranks)
    "dp2-tp2-zero3": dict(parallel_dp=2, parallel_tp=2, parallel_zero_stage=3, train_micro_batch_size=2),
    "dp2-tp2-zero1": dict(parallel_dp=2, parallel_tp=2, parallel_zero_stage=1, train_micro_batch_size=2),
    "tp2-cp2": dict(parallel_tp=2, parallel_cp=2, train_micro_batch_size=4),
    # DDP over cp with tp (DTensor parameters localized for DDP) and a block recomputed in backward:
    # crashed before issue 30 ("mixed torch.Tensor and DTensor")
    "tp2-sp-cp2-recompute-full": dict(
        parallel_tp=2, parallel_cp=2, train_micro_batch_size=4, train_recompute="full"
    ),
    "dp2-tp2-recompute-op": dict(
        parallel_dp=2,
        parallel_tp=2,
        parallel_sequence_parallel=False,
        train_micro_batch_size=2,
        train_recompute="op",
    ),
    "dp2-pp2-zero2": dict(
        parallel_dp=2,
        parallel_pp=2,
        parallel_zero_stage=2,
        train_micro_batch_size=1,
        train_num_microbatches=2,
    ),
    "dp2-pp2-zero0": dict(parallel_dp=2, parallel_pp=2, train_micro_batch_size=1, train_num_microbatches=2),
    "pp2-tp2-full": dict(
        parallel_pp=2,
        parallel_tp=2,
        train_micro_batch_size=2,
        train_num_microbatches=2,
        train_recompute="full",
    ),
    "dp2-cp2-zero2-accumulate": dict(
        parallel_dp=2,
        parallel_cp=2,
        parallel_zero_stage=2,
        train_micro_batch_size=1,
        train_num_microbatches=2,
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_single_rank(layout, reference):
    assert_same(run(**LAYOUTS[layout])["losses"], reference)


# Tied embeddings (issue 15): tensor parallelism used to give the head a matrix of its own, and the
# pipeline's two copies (embedding on the first stage, head on the last) were never summed.
TIED_LAYOUTS = {
    # the untied layouts of the same name, run tied
    **{
        k: LAYOUTS[k]
        for k in (
            "tp2-sp",
            "tp2-nosp",
            "dp2-tp2-zero1",
            "dp2-tp2-zero3",
            "pp2-1f1b",
            "pp2-interleaved",
            "dp2-zero3-torchtitan",  # the embedding joins the head's unit, as torchtitan wraps it
        )
    },
    "cp2": dict(parallel_cp=2, train_micro_batch_size=4),
    "pp2-tp2": dict(parallel_pp=2, parallel_tp=2, train_micro_batch_size=2, train_num_microbatches=2),
}


# In the default run: sequence-parallel tp, 1F1B and torchtitan's FSDP2 tied; -m slow runs every layout.
@pytest.mark.parametrize("layout", fast_few(TIED_LAYOUTS, ("tp2-sp", "pp2-1f1b", "dp2-zero3-torchtitan")))
def test_tied_layout_matches_single_rank(layout, tied_reference):
    assert_same(run(tied=True, **TIED_LAYOUTS[layout])["losses"], tied_reference)


def test_the_tied_check_catches_untied_training(tied_reference, reference, monkeypatch):
    # Guard for the guard: the tied and untied models train differently (tying is visible in the
    # losses), and a pipeline whose two copies are not summed fails the comparison from step 2 on.
    assert tied_reference[1] != pytest.approx(reference[1], rel=RTOL)
    monkeypatch.setattr(compose, "sync_tied_weight", lambda par: None)
    losses = run(tied=True, **TIED_LAYOUTS["pp2-1f1b"])["losses"]
    assert losses[0] == pytest.approx(tied_reference[0], rel=RTOL)
    assert losses[1] != pytest.approx(tied_reference[1], rel=RTOL)


# Qwen2's Q, K and V biases (issue 31 item 4): sharded with their columns under tensor parallelism,
# sequence parallelism and context parallelism leave them whole, FSDP2 shards them.
BIAS_LAYOUTS = {k: LAYOUTS[k] for k in ("tp2-sp", "dp2-tp2-zero3", "pp2-1f1b")} | {
    "cp2": dict(parallel_cp=2, train_micro_batch_size=4)
}


@pytest.fixture(scope="module")
def bias_reference() -> list[float]:
    return _reference(tied=False, bias=True)


@pytest.mark.parametrize("layout", fast_few(BIAS_LAYOUTS, ("dp2-tp2-zero3", "cp2")))
def test_qkv_bias_layout_matches_single_rank(layout, bias_reference, reference):
    assert bias_reference[1] != pytest.approx(reference[1], rel=RTOL)  # the biases change the step
    assert_same(run(bias=True, **BIAS_LAYOUTS[layout])["losses"], bias_reference)


def test_2x2x2_on_eight_processes(reference):
    # dp 2 × tp 2 × pp 2 = 8 ranks, FSDP (ZeRO-3) with sequence-parallel TP inside pipeline stages.
    record = run(
        parallel_dp=2,
        parallel_tp=2,
        parallel_pp=2,
        parallel_zero_stage=3,
        train_micro_batch_size=1,
        train_num_microbatches=2,
    )
    assert len(record["per_rank_peak_bytes"]) == 8
    assert_same(record["losses"], reference)


def test_the_check_catches_a_wrong_gradient_scale(reference, monkeypatch):
    # Guard for the guard: summing instead of averaging gradients over 2 data-parallel ranks (gradients
    # twice too large) must fail the comparison. Emulated by doubling the learning rate.
    monkeypatch.setattr(compose, "LEARNING_RATE", 4.0)
    losses = run(parallel_dp=2, train_micro_batch_size=2)["losses"]
    assert losses[0] == pytest.approx(reference[0], rel=RTOL)  # forward unchanged
    assert losses[1] != pytest.approx(reference[1], rel=RTOL)
