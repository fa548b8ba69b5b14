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


@pytest.mark.slow
@pytest.mark.parametrize("method", ["uniform", "block"])
def test_measured_peak_matches_the_torch_engine(method):
    s = spec("tiny", **POINT, train_recompute_method=method)
    record = run_point(s, timeout_s=240)
    assert record["status"] == "ok", record["error"]
    measured = record["peak_allocated_bytes"]
    assert estimate(s, engine="torch").total_bytes == pytest.approx(measured, rel=0.02)
    # Counted as torchtitan's every-N the estimate misses the method's working set by more than that.
    every = dataclasses.replace(s, train=dataclasses.replace(s.train, recompute_method="every"))
    assert estimate(every, engine="torch").total_bytes != pytest.approx(measured, rel=0.02)
