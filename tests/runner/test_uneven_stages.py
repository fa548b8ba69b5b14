"""Uneven pipeline stages (``parallel.pp_layers``, issue 31): each rank of a real run holds its own
stage's blocks, as the torch engine counts them stage by stage, and a fake run traces the same peaks.
(Loss equality against one rank: tests/runner/test_runner_parallel.py, layouts ``pp*-uneven``.)"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import in_fresh_process, spec

from harness.estimate import estimate
from harness.runner.fake.run import run_fake
from harness.runner.supervisor import run_point
from harness.spec import canonical


def uneven(counts, **kw):
    s = spec("tiny", parallel_pp=len(counts), train_num_microbatches=4, train_precision="fp32", **kw)
    return canonical(dataclasses.replace(s, parallel=dataclasses.replace(s.parallel, pp_layers=counts)))


@pytest.mark.parametrize("counts", [(1, 3), pytest.param((3, 1), marks=pytest.mark.slow)])
def test_each_stage_measures_what_the_engine_says_for_its_own_blocks(counts):
    s = uneven(counts)
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    stages = estimate(s).stages
    for stage, measured in zip(stages, real["per_rank_peak_bytes"], strict=True):
        assert measured == pytest.approx(stage.total_bytes, rel=0.02), (stage.stage, counts)
    # the stage with three blocks is the most loaded one, by more than the head's share alone
    heavy = counts.index(3)
    assert real["per_rank_peak_bytes"][heavy] > real["per_rank_peak_bytes"][1 - heavy]
    even = estimate(canonical(spec("tiny", parallel_pp=2, train_num_microbatches=4, train_precision="fp32")))
    assert [st.total_bytes for st in stages] != [st.total_bytes for st in even.stages]


def test_a_fake_run_traces_each_uneven_stage_as_the_real_run_measures_it():
    s = uneven((1, 3))
    # the trace from a fresh process: the test process may hold what earlier tests did under fake mode
    real, fake = run_point(s, timeout_s=240), in_fresh_process(run_fake, s)
    assert real["status"] == "ok" and fake["status"] == "ok", (real["error"], fake["error"])
    assert list(fake["fake_traced_ranks"]) == [0, 1]
    for rank, peak in zip(fake["fake_traced_ranks"], fake["per_rank_peak_bytes"], strict=True):
        assert peak == pytest.approx(real["per_rank_peak_bytes"][rank], rel=0.005)
    assert fake["sim_peak_reserved_bytes"] == real["sim_peak_reserved_bytes"]
