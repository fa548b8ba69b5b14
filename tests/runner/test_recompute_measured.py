"""Megatron's recompute methods (train.recompute_method) measured on one real CPU point each, against
the torch engine: within 2 %, the study's bound on under-prediction (issue 15), which the every-N points
of the committed CPU study meet (-1.2 % to +0.4 %)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import spec

from harness.estimate import estimate
from harness.runner.supervisor import run_point

POINT = dict(
    train_seq_len=512, train_micro_batch_size=4, train_precision="fp32", train_recompute="full",
    train_recompute_every=2,
)  # fmt: skip


def _measured_and_every(method: str) -> tuple[int, int]:
    s = spec("tiny", **POINT, train_recompute_method=method)
    record = run_point(s, timeout_s=600)  # slow-marked: a loaded machine takes minutes
    assert record["status"] == "ok", record["error"]
    measured = record["peak_allocated_bytes"]
    assert estimate(s, engine="torch").total_bytes == pytest.approx(measured, rel=0.02)
    every = dataclasses.replace(s, train=dataclasses.replace(s.train, recompute_method="every"))
    return measured, estimate(every, engine="torch").total_bytes


@pytest.mark.slow
def test_uniform_measured_peak_matches_the_torch_engine():
    # 2 groups of 2 blocks keep 2 inputs; every 2nd block keeps 2 inputs and 2 whole blocks, which the
    # estimate counted that way misses by more than the bound.
    measured, every = _measured_and_every("uniform")
    assert every != pytest.approx(measured, rel=0.02)


@pytest.mark.slow
def test_block_measured_peak_matches_the_torch_engine():
    # The first 2 blocks checkpointed keep what every 2nd does; they differ by the last block's
    # recomputation, which on one rank the loss's buffers hide (the torch engine's peak holds the
    # larger of the two), so both estimates agree here: measured 169,957,032 B, estimated 169,326,080 B.
    measured, every = _measured_and_every("block")
    assert every == pytest.approx(measured, rel=0.02)
