"""The stack choice keys (issue 28): train.grad_sync, gradients reduced after every micro-batch
(torchtitan's choice) or only after the last (DDP's no_sync, FSDP2's set_requires_gradient_sync(False));
parallel.fsdp_reshard_after_forward, torchtitan's ZeRO-3 policy. What a rank holds, measured or traced
against the torch engine, and the spec's one validation and canonical form. Loss equality with the
single-rank reference: tests/runner/test_runner_parallel.py (dp2-zero*-every-microbatch,
dp2-zero3-torchtitan)."""

from __future__ import annotations

import json

import pytest
from conftest import harness_cli, spec

from harness.estimate import estimate
from harness.runner.supervisor import run_point
from harness.spec import InvalidSpec, canonical, config_id


@pytest.mark.parametrize(("zero", "rel"), [(0, 0.01), (3, 0.04)])
def test_every_microbatch_holds_no_accumulated_copy_as_the_engine_says(zero, rel):
    # small, FP32, dp 2, 3 micro-batches. Measured on this machine (MiB, real / engine): ZeRO-0 last
    # 255.6 / 255.0, every 217.4 / 216.8 (DDP's buckets only, no no_sync copy beside them); ZeRO-3
    # last 176.2 / 175.6, every 159.9 / 156.5 (the FP32 shard accumulates, no unsharded gradients).
    # ZeRO-3's every varies between runs with the timing of gloo's asynchronous reduce-scatters:
    # 157.1 MiB on six runs in a row (2026-12-06), 162.7 on one CI run (engine 157.0), hence 4 %; the
    # accumulated copy it must not hold is 19 MiB more (last's 175.6).
    s = spec(
        "small",
        train_precision="fp32",
        parallel_dp=2,
        parallel_zero_stage=zero,
        train_num_microbatches=3,
        train_grad_sync="every_microbatch",
    )
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    assert estimate(s).total_bytes == pytest.approx(real["peak_allocated_bytes"], rel=rel)
    last = estimate(
        spec(
            "small", train_precision="fp32", parallel_dp=2, parallel_zero_stage=zero, train_num_microbatches=3
        )
    )
    assert estimate(s).total_bytes < last.total_bytes
    assert real["peak_allocated_bytes"] < last.total_bytes  # no accumulated copy, whatever the timing


def test_grad_sync_is_validated_and_canonical():
    every = dict(train_grad_sync="every_microbatch", train_num_microbatches=2)
    # Under pipelining torch's schedules reduce after the last micro-batch whatever the trainer asks:
    # torchtitan's every_microbatch with pp is this runner's last, one config_id.
    piped = dict(parallel_dp=2, parallel_pp=2, parallel_zero_stage=3)
    assert canonical(spec("tiny", **piped, **every)).train.grad_sync == "last"
    assert config_id(spec("tiny", **piped, **every)) == config_id(
        spec("tiny", **piped, train_num_microbatches=2)
    )
    with pytest.raises(
        InvalidSpec, match=r"train.grad_sync=.sometimes. must be one of last, every_microbatch"
    ):
        canonical(spec("tiny", train_grad_sync="sometimes"))
    # Nothing accumulated over data-parallel ranks: no choice to make, one config_id.
    assert canonical(spec("tiny", **every)).train.grad_sync == "last"  # dp 1
    one = dict(train_grad_sync="every_microbatch", train_num_microbatches=1, parallel_dp=2)
    assert config_id(spec("tiny", **one)) == config_id(spec("tiny", parallel_dp=2, train_num_microbatches=1))
    # The default leaves every earlier config_id as it was (an added field's default is not hashed).
    assert config_id(spec("tiny", parallel_dp=2, train_num_microbatches=2)) != config_id(
        spec("tiny", parallel_dp=2, **every)
    )


def test_fsdp_reshard_after_forward_is_validated_and_canonical():
    # torchtitan's policy: "default" reshards the blocks without a pipeline (ZeRO-3, the head kept) and
    # keeps the gathered parameters with one (ZeRO-2, the same run); "never" is ZeRO-2 everywhere;
    # ZeRO 0-2 and a single rank ignore it.
    def resolved(**kw):
        p = canonical(spec("tiny", parallel_dp=2, parallel_zero_stage=3, **kw)).parallel
        return p.zero_stage, p.fsdp_reshard_after_forward

    assert resolved(parallel_fsdp_reshard_after_forward="default") == (3, "default")  # the head kept
    assert resolved(parallel_fsdp_reshard_after_forward="default", parallel_pp=2) == (2, "always")
    assert resolved(parallel_fsdp_reshard_after_forward="always", parallel_pp=2) == (3, "always")
    assert resolved(parallel_fsdp_reshard_after_forward="never") == (2, "always")
    assert (
        canonical(
            spec("tiny", parallel_zero_stage=3, parallel_fsdp_reshard_after_forward="default")
        ).parallel.fsdp_reshard_after_forward
        == "always"
    )
    zero2 = spec("tiny", parallel_dp=2, parallel_zero_stage=2)
    assert config_id(
        spec("tiny", parallel_dp=2, parallel_zero_stage=3, parallel_fsdp_reshard_after_forward="never")
    ) == config_id(zero2)
    assert config_id(zero2) == config_id(
        spec("tiny", parallel_dp=2, parallel_zero_stage=2, parallel_fsdp_reshard_after_forward="never")
    )
    with pytest.raises(
        InvalidSpec, match=r"fsdp_reshard_after_forward=.sometimes. must be one of default, always, never"
    ):
        canonical(spec("tiny", parallel_fsdp_reshard_after_forward="sometimes"))


@pytest.mark.parametrize("seq_len", [2048, 8192])
def test_torchtitan_keeps_the_head_gathered_as_the_engine_says(seq_len):
    # parallel.fsdp_reshard_after_forward=default at ZeRO-3 without a pipeline: the final norm and head
    # are an FSDP2 unit kept unsharded from forward through the loss. Traced at paper width (Llama-3-8B
    # cut to 2 layers, dp 8, BF16, CUDA's kernels). Sequence 8192: the peak is the loss's, and it grows
    # by the head's BF16 parameters (v·h + h) in the trace as in the engine (traced 16,929 -> 17,931 MiB).
    # Sequence 2048: the peak moves after the loss, to the end of backward ("always": the root's
    # reduce-scatter, 8,351 MiB) or to the head unit's own reduce-scatter ("default": 7,480 MiB), each
    # counted from its trace (harness/estimate/buffers.py). The engine within 1 % of each.
    import dataclasses

    from harness.runner.fake.run import run_fake

    def point(policy):
        s = spec("llama3_8b", "h100_80gb", parallel_dp=8, parallel_zero_stage=3, train_seq_len=seq_len)
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, num_layers=2))
        p = dataclasses.replace(s.parallel, fsdp_reshard_after_forward=policy)
        return canonical(dataclasses.replace(s, parallel=p))

    traced, engine = {}, {}
    for policy in ("always", "default"):
        s = point(policy)
        row = run_fake(s)
        assert row["status"] == "ok", row["error"]
        traced[policy], engine[policy] = row["peak_allocated_bytes"], estimate(s).total_bytes
        assert engine[policy] == pytest.approx(traced[policy], rel=0.01)
    if seq_len == 8192:
        head = 2 * (128256 * 4096 + 4096)
        assert engine["default"] - engine["always"] == head
        assert traced["default"] - traced["always"] == pytest.approx(head, rel=0.01)
    else:
        assert traced["default"] < traced["always"] and engine["default"] < engine["always"]


@pytest.mark.slow  # 14 s: two real runs of small; docs/stacks.md's figure
def test_torchtitan_on_small_measures_above_the_engine_by_the_known_gap(tmp_path):
    # Real CPU runs of small, FP32, dp 2, ZeRO-3 over gloo (docs/stacks.md "Known gaps"): "always" within
    # 1 % of the engine; torchtitan's "default" measured 136.3 MiB against 129.5 (-5.0 %): over gloo the
    # head unit's gradient is held to backward's end and the embedding gathered again at its start
    # stays too, which the engine counts only in part. This pins the gap so that a change shows.
    measured = {}
    for policy in ("always", "default"):
        out = harness_cli(
            "run",
            "model=small",
            "train.precision=fp32",
            "parallel.dp=2",
            "parallel.zero_stage=3",
            f"parallel.fsdp_reshard_after_forward={policy}",
            "format=json",
            f"results_dir={tmp_path}",
        )
        real = json.loads(out.stdout)
        assert real["status"] == "ok", real["error"]
        measured[policy] = (real["peak_allocated_bytes"], real["est_total_bytes"])
    real, est = measured["always"]
    assert est == pytest.approx(real, rel=0.01)
    real, est = measured["default"]
    assert 0.93 < est / real < 0.97
