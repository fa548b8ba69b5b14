"""Issue 32 item 5 / issue 30 item 4: a fake trace and a real CPU trace of the same point replay to the
same reserved peak. DDP's first buckets were one difference: torch 2.13 starts with one bucket of every
parameter (no find_unused_parameters: size limit sys.maxsize) and rebuilds in the second step, while the
fake emulation started with 1 MiB + 25 MiB buckets, and replayed 4.8 % above the real run here. The
other was what a real run replayed: the CPU allocator's own trace, with the CPU kernels' scratch and
the intra-op threads' blocks, whose replay moved by a segment or two from run to run of one point;
both now replay the storages the step's operators make (runner/measure/peak.py REPLAYED_TRACE)."""

from __future__ import annotations

import json

import pytest
from conftest import harness_cli

POINT = (
    "model=small",
    "parallel.dp=2",
    "parallel.zero_stage=1",
    "train.num_microbatches=3",
    "train.precision=bf16",
    "format=json",
)


def _traced_ranks(real: dict, fake: dict):
    """Each traced rank of the fake run beside the same rank of the real run: (fake peak, real peak,
    fake replayed reserved peak, real replayed reserved peak)."""
    traced = (fake["fake_traced_ranks"], fake["per_rank_peak_bytes"], fake["per_rank_sim_reserved_bytes"])
    for rank, peak, reserved in zip(*traced, strict=True):
        yield peak, real["per_rank_peak_bytes"][rank], reserved, real["per_rank_sim_reserved_bytes"][rank]


def _record(point, mode: str, tmp_path) -> dict:
    done = harness_cli("run", *point, f"run.mode={mode}", f"results_dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["status"] == "ok", record.get("error")
    return record


def _real_and_fake(point, tmp_path) -> tuple[dict, dict]:
    """The records of ``point`` run once real and once fake, each ok."""
    return _record(point, "real", tmp_path), _record(point, "fake", tmp_path)


# One rank, BF16, full recomputation: the real run's replay read 62.9, 65.0 and 67.1 MiB in three runs
# of the CPU allocator's trace, the fake run's 60.8 MiB every time (issue 30: 35 of the BF16 study's
# 131 points were more than 1 % apart, by a segment or two).
ONE_RANK = ("model=tiny", "train.precision=bf16", "train.recompute=full", "train.seq_len=512", "format=json")


def test_one_rank_real_and_fake_runs_replay_the_same_operator_storages(tmp_path):
    real, fake = _real_and_fake(ONE_RANK, tmp_path)
    assert real["sim_trace"] == fake["sim_trace"] == "operator_storages"
    assert real["per_rank_sim_reserved_bytes"] == [real["sim_peak_reserved_bytes"]]
    assert fake["sim_peak_reserved_bytes"] == real["sim_peak_reserved_bytes"]
    assert fake["sim_peak_allocated_bytes"] == pytest.approx(real["sim_peak_allocated_bytes"], rel=1e-3)


# 14 s; by default test_fake.py's gloo pipeline test and test_uneven_stages hold fake and real replays equal
@pytest.mark.slow
@pytest.mark.parametrize("point", [POINT], ids=["ddp-zero1-accumulation-bf16"])
def test_fake_and_real_traces_replay_to_the_same_reserved_peak(point, tmp_path):
    real, fake = _real_and_fake(point, tmp_path)
    assert fake["peak_allocated_bytes"] == pytest.approx(real["peak_allocated_bytes"], rel=1e-3)
    assert fake["sim_peak_reserved_bytes"] == pytest.approx(real["sim_peak_reserved_bytes"], rel=0.01)


# Tensor parallelism with sequence parallelism under a pipeline, tied, BF16 (the BF16 study's point):
# gloo clones the input of DTensor's reduce-scatter, which the fake group did not (stage 0 traced 0.9 %
# below the real run; runner/fake/modes._gloo_functional_reduce_scatter_copies).
TP_SP_PP = (
    "model=tiny",
    "model.tie_embeddings=true",
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    "parallel.pp=2",
    "train.num_microbatches=2",
    "train.precision=bf16",
    "train.seq_len=512",
    "format=json",
)


# Four gloo ranks on this machine's two cores: once in about a dozen runs here, one real rank measured
# one BF16 logits tensor (4 MiB: 512 tokens x 4,096 words) more than its trace (47.05 against 42.68 MB),
# which is when a collective's worker thread freed a buffer after the step's peak instead of before.
# The fake trace is the run without that delay: a real run must reproduce it, in one of three tries.
TRIES = 3


def test_fake_trace_of_tp_sp_under_a_pipeline_holds_each_traced_rank_to_the_real_run(tmp_path):
    fake = _record(TP_SP_PP, "fake", tmp_path)
    assert fake["fake_traced_ranks"] == [0, 2]  # one rank of each stage
    seen = []
    for _ in range(TRIES):
        real = _record(TP_SP_PP, "real", tmp_path)
        pairs = list(_traced_ranks(real, fake))
        if all(
            peak == pytest.approx(real_peak, rel=0.005) and reserved == pytest.approx(real_reserved, rel=0.01)
            for peak, real_peak, reserved, real_reserved in pairs
        ):
            return
        seen.append(pairs)
    pytest.fail(
        f"no real run of {TRIES} held to the trace (fake, real, fake, real reserved per rank): {seen}"
    )


# The BF16 study's last points outside 1 %, each a segment short in the fake replay, each one mechanism
# (runner/fake): functional collectives waited at their output's first use, with the input the Work
# holds alive until then (modes._collectives_waited_at_first_use); DDP's rebuilt first bucket cut at
# 1 MiB (ddp._group); the targets a tensor of their own (trace.trace_rank).
_BF16 = ("model=tiny", "train.precision=bf16", "train.seq_len=512", "format=json")
EAGER_COLLECTIVES = (*_BF16, "parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=op")
FIRST_BUCKET = (
    *_BF16,
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    "parallel.cp=2",
    "parallel.zero_stage=0",
    "train.attention=math",
)
TARGETS = (*_BF16, "parallel.pp=2", "train.num_microbatches=4", "train.recompute=op")


@pytest.mark.parametrize(
    "point",
    [
        EAGER_COLLECTIVES,
        pytest.param(FIRST_BUCKET, marks=pytest.mark.slow),
        pytest.param(TARGETS, marks=pytest.mark.slow),
    ],
    ids=["tp2-sp-op", "tp2-sp-cp2-ddp-math", "pp2-op-m4"],
)
def test_every_traced_rank_replays_the_real_runs_reserved_peak(point, tmp_path):
    real, fake = _real_and_fake(point, tmp_path)
    for peak, real_peak, reserved, real_reserved in _traced_ranks(real, fake):
        assert peak == pytest.approx(real_peak, rel=0.005)
        assert reserved == real_reserved
