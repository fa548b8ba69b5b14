"""The runner's allocation traces: recorded during the measured step, written beside the record on request,
readable by PyTorch's own memory_viz, and replayed into the record's simulated reserved peak."""

from __future__ import annotations

import json

from conftest import spec
from torch.cuda import _memory_viz

from harness.alloc import TraceError, load_trace, replay
from harness.runner.supervisor import run_point


def _replayable(files: list[str]) -> bool:
    try:
        for f in files:
            replay(load_trace(f))
    except TraceError:
        return False
    return True


def test_a_run_writes_one_trace_per_rank_and_its_replay_is_the_record(tmp_path):
    s = spec("tiny", train_precision="fp32", train_seq_len=64, parallel_dp=2, parallel_zero_stage=3)
    for attempt in range(2):
        out = tmp_path / f"try{attempt}"
        record = run_point(
            s, timeout_s=240, artifacts={"trace_dir": out, "write_trace": True, "memory_snapshot": False}
        )
        assert record["status"] == "ok", record["error"]
        # A free on a gloo thread that cannot be told apart from another block's makes the replay hold
        # a block too long (see the bounds below; it read 9.0 % over once in CI), or leaves an address
        # allocated twice, so that one rank's trace does not replay at all (the record then takes its
        # figures from the other rank; seen once in CI). Such a run is run again, and the second is
        # held to every assertion below.
        if record["sim_peak_allocated_bytes"] <= 1.07 * record["peak_allocated_bytes"] and _replayable(
            record["trace_files"]
        ):
            break
    files = record["trace_files"]
    assert [f.split(".")[-3] for f in files] == ["rank0", "rank1"]
    assert all(f.startswith(str(out / record["config_id"])) for f in files)
    with open(files[0]) as f:
        snapshot = json.load(f)
    # PyTorch's memory_viz reads it as a snapshot (its text trace and its HTML plot).
    assert "entries" in _memory_viz.trace(snapshot)
    assert "<html>" in _memory_viz.trace_plot(snapshot)
    # Replaying the file gives what the record says (the record's rank is the one with the larger peak).
    peaks = [replay(load_trace(f)) for f in files]
    top = max(peaks, key=lambda r: r.peak_reserved_bytes)
    assert record["sim_peak_reserved_bytes"] == top.peak_reserved_bytes
    assert record["sim_fragmentation_bytes"] == top.fragmentation_bytes
    # Reserved holds allocated. The replay's allocated peak is the operators' storages (MemTracker's
    # view, runner/measure/peak.py REPLAYED_TRACE) rounded to 512 B blocks; the measured one is the CPU
    # allocator's, which also holds what C++ makes out of the tracker's sight (gloo's copy of a
    # reduce-scatter's input): the replay sits at most 3 % below it and never above it by more than the
    # rounding.
    assert record["sim_peak_reserved_bytes"] >= record["sim_peak_allocated_bytes"] > 0
    assert 0.97 * record["peak_allocated_bytes"] <= record["sim_peak_allocated_bytes"]
    assert record["sim_peak_allocated_bytes"] <= 1.01 * record["peak_allocated_bytes"]


def test_without_run_trace_nothing_is_written_but_the_record_still_has_the_simulation(tmp_path):
    record = run_point(spec("tiny", train_precision="fp32", train_seq_len=64), timeout_s=240)
    assert record["status"] == "ok", record["error"]
    assert record["trace_files"] is None
    assert record["sim_peak_reserved_bytes"] >= record["sim_peak_allocated_bytes"] > 0


def test_memory_snapshot_files_are_named_per_rank_and_moment(tmp_path, monkeypatch):
    """run.memory_snapshot (CUDA only; no GPU here): the worker dumps PyTorch's snapshot per rank after
    the measured steps ("peak") and at an out-of-memory ("oom"), named after the point, into
    results_dir; the sweep and run pass the directory only when asked."""
    import torch

    from harness.runner.worker import _Artifacts
    from harness.spec import spec_id
    from harness.sweep.launch import run_artifacts

    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: dumped.append(path))
    s = spec("tiny")
    art = _Artifacts(s, 3, None, tmp_path, True)
    peak, oom = art.dump_snapshot("peak"), art.dump_snapshot("oom")
    assert peak == str(tmp_path / f"{spec_id(s)}.rank3.peak.snapshot.pickle")
    assert oom == str(tmp_path / f"{spec_id(s)}.rank3.oom.snapshot.pickle")
    assert dumped == [peak, oom]
    assert _Artifacts(s, 0, None, tmp_path, False).dump_snapshot("peak") is None  # not asked: nothing
    cfg = {"results_dir": str(tmp_path), "run": {"trace": False, "memory_snapshot": True}}
    assert run_artifacts(cfg) == {"trace_dir": tmp_path, "write_trace": False, "memory_snapshot": True}
    assert run_artifacts({"results_dir": "x", "run": {"trace": False, "memory_snapshot": False}}) == {}
