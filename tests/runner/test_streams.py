"""The CUDA stream of each traced allocation (issue 13 item 2): FSDP2's all-gather outputs on its copy-in
stream (1), its reduce-scatter outputs on its reduce-scatter stream (2), everything else, DDP's buckets
included, on the default stream (0), in real CPU runs and fake runs alike (harness/runner/measure)."""

from __future__ import annotations

import json
from collections import Counter

from conftest import in_fresh_process, spec
from torch.cuda import _memory_viz

from harness.alloc import load_trace, replay
from harness.runner.measure.trace import (
    DEFAULT_STREAM,
    FSDP_ALL_GATHER_STREAM,
    FSDP_REDUCE_SCATTER_STREAM,
)
from harness.runner.supervisor import run_point

# tiny (sweeps/model/tiny.yaml), FP32, dp 2, ZeRO-3: FSDP2 groups each block and the root (data.py).
# A block: attention 128·128 (q) + 128·64 (k) + 128·64 (v) + 128·128 (o) = 49 152, SwiGLU 3·128·352 =
# 135 168, two norms 2·128 = 256: 184 576 parameters, its all-gather output 184 576·4 B = 738 304 B.
# The root: embedding 4096·128 + head 4096·128 + final norm 128 = 1 048 704, 4 194 816 B. Each group's
# reduce-scatter output is its rank's half: 369 152 B and 2 097 408 B (every dim 0 is even: no padding).
BLOCK_AG, ROOT_AG = 738_304, 4_194_816
BLOCK_RS, ROOT_RS = BLOCK_AG // 2, ROOT_AG // 2
# The measured step all-gathers the root and the 4 blocks in forward and, all of them resharded after
# forward (reshard_after_forward=True is passed for the root too), again in backward, each on the
# copy-in stream; backward reduce-scatters each group once, and gloo copies each group's whole
# gradient for it on the reduce-scatter stream (the copy is gloo's: NCCL makes none).
ALL_GATHERS = Counter({BLOCK_AG: 8, ROOT_AG: 2})
REDUCE_SCATTERS = Counter({BLOCK_RS: 4, ROOT_RS: 1, BLOCK_AG: 4, ROOT_AG: 1})


def _side_streams(events) -> dict[int, Counter]:
    """Sizes of the allocations on each stream but the default one."""
    out: dict[int, Counter] = {}
    for e in events:
        if e["action"] == "alloc" and e["stream"] != DEFAULT_STREAM:
            out.setdefault(e["stream"], Counter())[e["size"]] += 1
    return out


def _frees_on_their_allocations_stream(events) -> bool:
    stream_of = {}
    for e in events:
        if e["action"] == "alloc":
            stream_of[e["addr"]] = e["stream"]
        elif e["action"] == "free_completed" and stream_of.pop(e["addr"], e["stream"]) != e["stream"]:
            return False
    return True


def _traced_run(tmp_path, **parallel):
    s = spec("tiny", train_precision="fp32", train_seq_len=64, parallel_dp=2, **parallel)
    record = run_point(
        s, timeout_s=240, artifacts={"trace_dir": tmp_path, "write_trace": True, "memory_snapshot": False}
    )
    assert record["status"] == "ok", record["error"]
    return record


def _check_fsdp2_streams(record) -> None:
    for path in record["trace_files"]:
        events = load_trace(path)
        assert _side_streams(events) == {
            FSDP_ALL_GATHER_STREAM: ALL_GATHERS,
            FSDP_REDUCE_SCATTER_STREAM: REDUCE_SCATTERS,
        }
        assert _frees_on_their_allocations_stream(events)
        # The streams change the replay's reserved peak, never its allocated one: the root's all-gather
        # (4 MiB) and reduce-scatter (2 MiB) output, between 1 and 10 MiB, each open a 20 MiB segment
        # of their own stream, and the blocks' (under 1 MiB) 2 MiB ones, where on stream 0 they were
        # served from the default stream's cached blocks.
        tagged, untagged = replay(events), replay([{**e, "stream": 0} for e in events])
        assert tagged.peak_allocated_bytes == untagged.peak_allocated_bytes
        assert tagged.peak_reserved_bytes >= tagged.peak_allocated_bytes
        assert tagged.peak_reserved_bytes > untagged.peak_reserved_bytes
        # PyTorch's memory_viz still reads the file.
        with open(path) as f:
            snapshot = json.load(f)
        assert "entries" in _memory_viz.trace(snapshot)
        assert "<html>" in _memory_viz.trace_plot(snapshot)


def test_fsdp2_all_gathers_are_on_stream_1_and_reduce_scatters_on_stream_2_in_a_real_cpu_trace(tmp_path):
    # Before the streams were known, every allocation of a CPU trace was on stream 0. (The trace was
    # once rebuilt from the CPU allocator's events, where a free on a gloo thread was sometimes not told
    # apart, and the test ran twice; the operators' storages need no such guess.)
    _check_fsdp2_streams(_traced_run(tmp_path, parallel_zero_stage=3))


def test_ddp_allocates_everything_on_the_default_stream(tmp_path):
    # DDP's buckets are made on the default stream and all-reduced in place (measure.py, the stream
    # constants): no allocation of its step is on a side stream.
    record = _traced_run(tmp_path, parallel_zero_stage=0)
    for path in record["trace_files"]:
        events = load_trace(path)
        assert len(events) > 100
        assert {e["stream"] for e in events} == {DEFAULT_STREAM}


def _fake_trace(s) -> tuple[dict, list[dict]]:
    """A fake rank 0's record and the trace its sim_* figures replayed (in a fresh process)."""
    from harness.runner.fake.trace import trace_rank

    record = trace_rank(s, 0, keep_trace=True)
    events = record.pop("trace")
    return record, [{k: e[k] for k in ("action", "addr", "size", "stream")} for e in events]


def test_fake_fsdp2_trace_has_the_same_streams_and_its_sim_figures_replay_them():
    s = spec("tiny", train_precision="fp32", train_seq_len=64, parallel_dp=2, parallel_zero_stage=3)
    record, events = in_fresh_process(_fake_trace, s)
    assert _side_streams(events) == {
        FSDP_ALL_GATHER_STREAM: ALL_GATHERS,
        FSDP_REDUCE_SCATTER_STREAM: REDUCE_SCATTERS,
    }
    assert _frees_on_their_allocations_stream(events)
    tagged, untagged = replay(events), replay([{**e, "stream": 0} for e in events])
    assert record["sim_peak_reserved_bytes"] == tagged.peak_reserved_bytes > untagged.peak_reserved_bytes
    assert tagged.peak_reserved_bytes >= tagged.peak_allocated_bytes
