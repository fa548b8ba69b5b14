"""A dry run (one process, fake process group, FakeTensorMode) measures what the real rank holds."""

from __future__ import annotations

import pytest
from conftest import in_fresh_process, spec

from harness.runner.supervisor import run_point


def _dry(s):
    from harness.runner.dryrun import dry_run_peak

    return dry_run_peak(s)


def _real_and_fake(**kw) -> tuple[int, int]:
    s = spec(
        "small", train_precision="fp32", train_seq_len=256, train_micro_batch_size=2, train_steps=2, **kw
    )
    fake = in_fresh_process(_dry, s)
    assert fake["memory_method"] == "fake"
    traced = fake["peak_allocated_bytes"]
    real = _real_rank0(s)
    if real != pytest.approx(traced, rel=0.005):
        # A real rank's peak depends on when gloo's worker thread frees its buffers: with 4 ranks on 2
        # cores it read 168,365,124 B once, where other runs match the trace's 165,434,420 B (README,
        # "What the study shows", and results/runner_checks/repeatable_peaks.txt). A late free only
        # raises a peak, so the lower of two runs is the repeatable one.
        real = min(real, _real_rank0(s))
    return real, traced


def _real_rank0(s) -> int:
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    return real["per_rank_peak_bytes"][0]


@pytest.mark.slow  # (13 s; fake FSDP2 ranks against real ones: also tests/runner/test_fake.py)
def test_fsdp_dry_run_equals_the_real_rank():
    real, fake = _real_and_fake(parallel_dp=4, parallel_zero_stage=3)
    # Real rank 0 also holds the step's token ids and targets (28 KiB here); nothing else differs.
    assert fake == pytest.approx(real, rel=0.005)


@pytest.mark.slow  # 8 s; the FSDP2 dry run stays in the default run
def test_tensor_parallel_dry_run_equals_the_real_rank():
    # It read +5.9 % for tp 2 with sequence parallelism: MemTracker counted DTensor's sharding
    # propagation (global-shape fake tensors, loss_parallel's whole-vocabulary log-softmax among them),
    # made in the trace's own fake mode (harness/runner/fake _private_sharding_propagation). Now
    # 140,862,268 B traced against 140,866,376 B measured.
    real, fake = _real_and_fake(parallel_tp=2)
    assert fake == pytest.approx(real, rel=0.005)
