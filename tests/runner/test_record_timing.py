"""The record's step timing: the slowest rank's median, its per-step times and their spread (issue 17
item 4), assembled from the ranks' numbers without launching anything."""

from __future__ import annotations

import math

import pandas as pd
from conftest import spec

from harness.runner.record import finish_record, step_timing
from harness.sweep.store import load_results, write_record


def rank(r: int, times: list[float]) -> dict:
    """What a worker writes for a rank that finished (only the fields finish_record reads)."""
    ordered = sorted(times)
    median = ordered[len(ordered) // 2] if times else math.nan  # odd counts only here
    return {
        "rank": r,
        "peak_allocated_bytes": 1000 + r,
        "memory_method": "memtracker",
        "losses": [10.0, 9.5],
        "step_times_s": times,
        "step_time_s": median,
    }


def test_slowest_rank_sets_step_time_and_spread():
    # rank 0: median 1.0; rank 1: steps 1.1, 1.4, 1.2 -> median 1.2, the slowest.
    # spread = (1.4 - 1.1) / 1.2 = 0.25
    out = step_timing([rank(0, [1.0, 0.9, 1.05]), rank(1, [1.1, 1.4, 1.2])])
    assert out["step_time_s"] == 1.2
    assert out["step_time_rank"] == 1
    assert out["step_times_s"] == [1.1, 1.4, 1.2]  # in the order they ran
    assert math.isclose(out["step_time_spread"], 0.25)


def test_spread_is_undefined_with_one_timed_step():
    out = step_timing([rank(0, [2.0])])
    assert out["step_time_s"] == 2.0 and out["step_times_s"] == [2.0]
    assert math.isnan(out["step_time_spread"])


def test_record_carries_timing_and_survives_the_store(tmp_path):
    s = spec("tiny", parallel_dp=2, train_precision="fp32", train_seq_len=32, train_steps=4)
    ranks = [rank(0, [0.50, 0.40, 0.45]), rank(1, [0.30, 0.30, 0.30])]
    row = finish_record(
        s, ranks, status="ok", error=None, error_rank=None, exit_code=0, wall_s=3.0, device_name="cpu"
    )
    # rank 0 is the slowest (median 0.45 > 0.30): spread (0.50 - 0.40) / 0.45 = 0.2222...
    assert row["step_time_s"] == 0.45 and row["step_time_rank"] == 0
    assert math.isclose(row["step_time_spread"], 0.1 / 0.45)
    # throughput still follows the median: global batch 2 sequences x 32 tokens / 0.45 s
    assert math.isclose(row["tokens_per_s"], s.global_batch_size * 32 / 0.45)
    write_record(row, tmp_path)
    # A row recorded before these fields existed loads beside it with the cells left empty.
    old = {k: v for k, v in row.items() if k not in ("step_times_s", "step_time_rank", "step_time_spread")}
    write_record({**old, "config_id": "old0000000000"}, tmp_path)
    frame, bad = load_results(tmp_path)
    assert not bad and len(frame) == 2
    new = frame.set_index("config_id").loc[row["config_id"]]
    assert list(new["step_times_s"]) == [0.50, 0.40, 0.45]
    assert math.isclose(new["step_time_spread"], 0.1 / 0.45)
    assert pd.isna(frame.set_index("config_id").loc["old0000000000", "step_time_spread"])


def test_run_table_says_how_the_step_was_timed():
    from harness.cli.render.run import _timing

    row = {"step_times_s": [0.5, 0.4, 0.45], "step_time_rank": 0, "step_time_spread": 0.1 / 0.45}
    assert _timing(row) == "median of 3 steps on rank 0, the slowest; spread (max - min) / median 22.2%"
    assert _timing({**row, "step_times_s": [0.5], "step_time_spread": math.nan}) == (
        "median of 1 step on rank 0, the slowest"
    )
