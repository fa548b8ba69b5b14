"""A dry run (one process, fake process group, FakeTensorMode) measures what the real rank holds."""

from __future__ import annotations

import pytest
from conftest import in_fresh_process, spec

from harness.runner.supervisor import run_point


def _dry(s):
    from harness.runner.dryrun import dry_run_peak

    return dry_run_peak(s)


@pytest.mark.parametrize(
    "kw",
    [
        dict(parallel_dp=4, parallel_zero_stage=3),  # FSDP over 4 ranks
        dict(parallel_tp=2),  # tensor + sequence parallel
    ],
    ids=["fsdp-dp4", "tp2"],
)
def test_dry_run_equals_the_real_rank(kw):
    s = spec(
        "small", train_precision="fp32", train_seq_len=256, train_micro_batch_size=2, train_steps=2, **kw
    )
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    fake = in_fresh_process(_dry, s)
    assert fake["memory_method"] == "mem_tracker_fake"
    # Real rank 0 also holds the step's token ids and targets; nothing else may differ.
    assert fake["peak_allocated_bytes"] == pytest.approx(real["per_rank_peak_bytes"][0], rel=0.005)
