"""``train.loss_chunks`` (torchtitan's ``ChunkedLossWrapper``, runner/parallel/loss.py): the head and
the loss over N slices of a rank's tokens, each slice's backward at once.

Checked the way the field checks it: the losses of every layout the runner builds with it equal the
single-rank reference (the unchunked loss on the same global batch) to 2e-4, as in
test_runner_parallel.py. The engine against fake traces at paper width where it is traced."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import fast_few, spec

# The run, the single-rank references and the gradient-sensitive optimizer of the parallel runner's own
# loss-equality tests (RTOL 2e-4): imported, the fixtures apply here as there.
from test_runner_parallel import (  # noqa: F401  (fixtures, found by name)
    assert_same,
    gradient_sensitive_adam,
    reference,
    run,
    tied_reference,
)

from harness.estimate import estimate
from harness.spec import InvalidSpec, apply_stack, canonical, config_id

LAYOUTS = {
    "one-rank": dict(train_micro_batch_size=4, train_loss_chunks=4),
    "accumulate2": dict(train_micro_batch_size=2, train_num_microbatches=2, train_loss_chunks=2),
    "dp2-zero3": dict(parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2, train_loss_chunks=4),
    "dp2-zero2-accumulate2": dict(
        parallel_dp=2,
        parallel_zero_stage=2,
        train_micro_batch_size=1,
        train_num_microbatches=2,
        train_loss_chunks=4,
    ),
    "cp2-zero3": dict(parallel_cp=2, parallel_zero_stage=3, train_micro_batch_size=4, train_loss_chunks=4),
    # the schedules' first step infers shapes by running the loss (runner/parallel/loss.PipelineLoss)
    "pp2-1f1b": dict(parallel_pp=2, train_micro_batch_size=2, train_num_microbatches=2, train_loss_chunks=4),
    "pp2-gpipe": dict(
        parallel_pp=2,
        parallel_pp_schedule="gpipe",
        train_micro_batch_size=2,
        train_num_microbatches=2,
        train_loss_chunks=2,
    ),
    "pp2-interleaved": dict(
        parallel_pp=2,
        parallel_pp_schedule="interleaved_1f1b",
        parallel_virtual_stages=2,
        train_micro_batch_size=2,
        train_num_microbatches=2,
        train_loss_chunks=2,
    ),
    "pp2-dp2-zero0": dict(
        parallel_pp=2, parallel_dp=2, train_micro_batch_size=1, train_num_microbatches=2, train_loss_chunks=2
    ),
    "pp2-dp2-zero3": dict(
        parallel_pp=2,
        parallel_dp=2,
        parallel_zero_stage=3,
        train_micro_batch_size=1,
        train_num_microbatches=2,
        train_loss_chunks=2,
    ),
    "dp2-zero0": dict(parallel_dp=2, train_micro_batch_size=2, train_loss_chunks=4),
    "dp2-zero1-accumulate2": dict(
        parallel_dp=2,
        parallel_zero_stage=1,
        train_micro_batch_size=1,
        train_num_microbatches=2,
        train_loss_chunks=2,
    ),
    "cp2-zero0": dict(parallel_cp=2, train_micro_batch_size=4, train_loss_chunks=4),
    "tp2-sp": dict(parallel_tp=2, train_micro_batch_size=4, train_loss_chunks=4),
    "tp2-nosp": dict(
        parallel_tp=2, parallel_sequence_parallel=False, train_micro_batch_size=4, train_loss_chunks=4
    ),
    "dp2-tp2-zero3": dict(
        parallel_dp=2, parallel_tp=2, parallel_zero_stage=3, train_micro_batch_size=2, train_loss_chunks=2
    ),
    "dp2-tp2-zero1": dict(
        parallel_dp=2, parallel_tp=2, parallel_zero_stage=1, train_micro_batch_size=2, train_loss_chunks=2
    ),
    "pp2-tp2": dict(
        parallel_pp=2, parallel_tp=2, train_micro_batch_size=2, train_num_microbatches=2, train_loss_chunks=2
    ),
    "tied-tp2-sp": dict(tied=True, parallel_tp=2, train_micro_batch_size=4, train_loss_chunks=4),
    "tied-dp2-zero0": dict(tied=True, parallel_dp=2, train_micro_batch_size=2, train_loss_chunks=2),
    "tied-dp2-zero3": dict(
        tied=True, parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2, train_loss_chunks=4
    ),
}


@pytest.mark.parametrize("layout", fast_few(LAYOUTS, ("dp2-zero3", "dp2-zero0", "tp2-sp", "pp2-1f1b")))
def test_chunked_loss_matches_the_single_rank_reference(layout, request):
    kw = dict(LAYOUTS[layout])
    tied = kw.pop("tied", False)
    assert_same(
        run(tied=tied, **kw)["losses"], request.getfixturevalue("tied_reference" if tied else "reference")
    )


def test_chunked_loss_is_validated_and_torchtitans_stack_sets_it():
    with pytest.raises(
        InvalidSpec, match=r"train.loss_chunks=3 must divide a rank's tokens per micro-batch, "
    ):
        canonical(spec("tiny", train_seq_len=64, train_loss_chunks=3))
    with pytest.raises(InvalidSpec, match=r"train.loss_chunks=0 must be an integer >= 1"):
        canonical(spec("tiny", train_loss_chunks=0))
    cfg = {"model": {}, "parallel": {}, "train": {}, "device": {"name": "h100_80gb"}}
    assert apply_stack({**cfg, "stack": "torchtitan"})[0]["train"]["loss_chunks"] == 8
    assert apply_stack({**cfg, "stack": "megatron"})[0]["train"]["loss_chunks"] == 1
    assert apply_stack({**cfg, "stack": "harness"})[0]["train"]["loss_chunks"] == 1


def test_chunked_loss_makes_both_fsdp_policies_one_run_and_leaves_unchunked_ids_alone():
    kw = dict(parallel_dp=2, parallel_zero_stage=3, train_loss_chunks=2)
    always = spec("tiny", **kw, parallel_fsdp_reshard_after_forward="always")
    default = spec("tiny", **kw, parallel_fsdp_reshard_after_forward="default")
    assert always == default  # the loss keeps the head's own unit gathered through its slices either way
    # the new key at its default leaves every committed row's config_id as it was
    assert config_id(spec("tiny")) == "e87f72fa4b36e12f"
    assert config_id(spec("tiny", train_loss_chunks=2)) != config_id(spec("tiny"))


TRACED = {
    "one-rank": {},
    "dp8-zero3": dict(parallel_dp=8, parallel_zero_stage=3),
    "dp8-zero3-op": dict(parallel_dp=8, parallel_zero_stage=3, train_recompute="op"),
    "dp4-zero3-microbatch2": dict(parallel_dp=4, parallel_zero_stage=3, train_micro_batch_size=2),
    "cp2-dp4-zero3": dict(parallel_cp=2, parallel_dp=4, parallel_zero_stage=3),
    "dp8-zero2-accumulate2": dict(parallel_dp=8, parallel_zero_stage=2, train_num_microbatches=2),
    "dp8-zero3-op-every-microbatch": dict(
        parallel_dp=8,
        parallel_zero_stage=3,
        parallel_fsdp_reshard_after_forward="default",
        train_num_microbatches=2,
        train_recompute="op",
        train_grad_sync="every_microbatch",
    ),
    "pp2-dp4-zero3-m2": dict(parallel_pp=2, parallel_dp=4, parallel_zero_stage=3, train_num_microbatches=2),
    "pp2-dp4-zero3-m4": dict(parallel_pp=2, parallel_dp=4, parallel_zero_stage=3, train_num_microbatches=4),
    "pp2-dp4-zero0-m2": dict(parallel_pp=2, parallel_dp=4, train_num_microbatches=2),
    "tp2-dp4-zero3": dict(parallel_tp=2, parallel_dp=4, parallel_zero_stage=3),
    "tp2-nosp": dict(parallel_tp=2, parallel_sequence_parallel=False),
    "pp2-tp2-dp2-zero3-m2": dict(
        parallel_pp=2, parallel_tp=2, parallel_dp=2, parallel_zero_stage=3, train_num_microbatches=2
    ),
    "dp8-zero1": dict(parallel_dp=8, parallel_zero_stage=1),
    "dp4-zero0-m2": dict(parallel_dp=4, parallel_zero_stage=0, train_num_microbatches=2),
}


@pytest.mark.parametrize(
    "layout", fast_few(TRACED, ("dp8-zero3", "pp2-dp4-zero3-m4", "dp8-zero2-accumulate2"))
)
def test_the_engine_holds_the_chunked_loss_to_its_fake_trace(layout):
    # Llama-3-8B cut to 2 layers, s 8192, BF16, CUDA's kernels, 8 slices: the loss's chain shrinks to
    # a slice's; the head's gradient, its reduce-scatter at the last slice and the hidden states' FP32
    # gradient appear (estimate/buffers.chunked_loss*; docs/stacks.md's table, which also has GPipe
    # without data parallelism, 5.5 % over). The engine within 2 % of the worst traced rank.
    from harness.runner.fake.run import run_fake

    def point(chunks):
        s = spec(
            "llama3_8b", "h100_80gb", **{"train_seq_len": 8192, "train_recompute": "none", **TRACED[layout]}
        )
        s = dataclasses.replace(
            s,
            model=dataclasses.replace(s.model, num_layers=2),
            train=dataclasses.replace(s.train, loss_chunks=chunks),
        )
        return canonical(s)

    rows = {c: run_fake(point(c)) for c in (1, 8)}
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
    assert rows[8]["peak_allocated_bytes"] < 0.95 * rows[1]["peak_allocated_bytes"]
    engine = estimate(point(8)).total_bytes
    assert engine == pytest.approx(rows[8]["peak_allocated_bytes"], rel=0.02)
