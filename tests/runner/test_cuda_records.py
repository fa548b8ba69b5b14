"""The CUDA branch of the measurement (issue 33 items 5 and 10), run on the CPU against a fake
``torch.cuda``: the allocator settings the replay uses, the timed window it covers, the segment counts,
the retry deltas, and the environment's versions read without initialising CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import spec

from harness.alloc.settings import alloc_conf_from_env, replay_settings
from harness.runner.measure import peak
from harness.runner.measure.trace import history_mark, window_start
from harness.runner.record import environment, finish_record

MIB = 1 << 20
SEG = 0x7F00_0000_0000  # a segment the real allocator holds at the window's start
NATIVE = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,  # SIZE_MAX written as int64
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
}


def _ev(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


# Before the window: the 20 MiB segment opened, 4 MiB of it allocated (kept), 2 MiB made and freed.
BEFORE = [
    _ev("segment_alloc", SEG, 20 * MIB, 1),
    _ev("alloc", SEG, 4 * MIB, 2),
    _ev("alloc", SEG + 4 * MIB, 2 * MIB, 3),
    _ev("free_completed", SEG + 4 * MIB, 2 * MIB, 4),
]
START_SEGMENTS = [
    {
        "device": 0,
        "address": SEG,
        "total_size": 20 * MIB,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "blocks": [
            {"address": SEG, "size": 4 * MIB, "requested_size": 4 * MIB, "state": "active_allocated"},
            {"address": SEG + 4 * MIB, "size": 16 * MIB, "requested_size": 0, "state": "inactive"},
        ],
    }
]
# The timed window: 8 MiB from the cached 16 MiB (no new segment), then 30 MiB (a new segment, which
# the real allocator's trace shows as one segment_alloc), both freed, and the start's 4 MiB block freed.
WINDOW = [
    _ev("alloc", SEG + 4 * MIB, 8 * MIB, 10),
    _ev("segment_alloc", SEG + 64 * MIB, 30 * MIB, 11),
    _ev("alloc", SEG + 64 * MIB, 30 * MIB, 12),
    _ev("free_requested", SEG + 64 * MIB, 30 * MIB, 13),
    _ev("free_completed", SEG + 64 * MIB, 30 * MIB, 14),
    _ev("free_completed", SEG + 4 * MIB, 8 * MIB, 15),
    _ev("free_completed", SEG, 4 * MIB, 16),
]


class FakeCuda:
    """The torch.cuda entry points the measurement calls, recording them; two snapshots (the window's
    start and end) and two memory_stats reads (before and after)."""

    def __init__(self, settings=None, backend="native", window=WINDOW, stats=None):
        self.calls: list[str] = []
        self.settings = NATIVE if settings is None else settings
        self.backend = backend
        self.snapshots = [
            {"segments": START_SEGMENTS, "device_traces": [BEFORE], "allocator_settings": self.settings},
            {"segments": [], "device_traces": [BEFORE + window], "allocator_settings": self.settings},
        ]
        self.stats = stats or [{}, {"reserved_bytes.all.peak": 50 * MIB}]

    def install(self, monkeypatch, *, history=True):
        def record(name, value=None):
            def fn(*args, **kwargs):
                self.calls.append(name)
                return value() if callable(value) else value

            return fn

        monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats"))
        monkeypatch.setattr(torch.cuda, "memory_stats", record("memory_stats", lambda: self.stats.pop(0)))
        monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (80 * MIB, 100 * MIB)))
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", record("backend", self.backend))
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", record("_snapshot", self._snapshot))
        monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", record("reset_accumulated"))
        monkeypatch.setattr(peak, "_cuda_history", history)
        return self

    def _snapshot(self):
        if self.backend == "cudaMallocAsync":
            raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful.")
        return self.snapshots.pop(0)


def _measure(fake, monkeypatch, *, history=True):
    fake.install(monkeypatch, history=history)
    memory = peak.PeakMemory([], None, torch.device("cuda", 0))
    with memory.measure():
        pass
    return memory.result(), memory


@pytest.fixture
def spy(monkeypatch):
    """The keyword arguments each replay of the measurement was run with."""
    seen: list[dict] = []
    real = peak.simulated

    def simulated(events, **kwargs):
        seen.append(kwargs)
        return real(events, **kwargs)

    monkeypatch.setattr(peak, "simulated", simulated)
    return seen


def test_replay_covers_the_window_from_the_real_state_and_counts_its_segments(monkeypatch, spy):
    result, memory = _measure(FakeCuda(), monkeypatch)
    assert "sim_skipped_reason" not in result
    # Only the window's events are replayed, from the snapshot's segments at its start.
    assert memory.trace["device_traces"] == [WINDOW]
    assert spy[0]["initial_segments"] == START_SEGMENTS
    # One segment_alloc in the window (the one before it is not counted); the model, starting from the
    # real cache, serves 8 MiB from the cached 16 MiB and opens one 30 MiB segment for the rest.
    assert result["segment_allocs_measured"] == 1
    assert result["sim_segments_opened"] == 1
    # Peaks: the 20 MiB segment held from the start plus the 30 MiB one; allocated 4 + 8 + 30 MiB.
    assert result["sim_peak_reserved_bytes"] == 50 * MIB
    assert result["sim_peak_allocated_bytes"] == 42 * MIB
    assert spy[0]["expandable_segments"] is False and spy[0]["max_split_size_mb"] is None


def test_expandable_segments_in_the_snapshot_settings_replay_with_expandable(monkeypatch, spy):
    settings = {**NATIVE, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    result, _ = _measure(FakeCuda(settings), monkeypatch)
    assert spy[0]["expandable_segments"] is True
    assert result["sim_expandable_segments"] is True
    assert result["allocator_settings"] == "expandable_segments:True"
    assert result["allocator_settings_source"] == "snapshot"


def test_max_split_size_in_the_snapshot_settings_is_replayed(monkeypatch, spy):
    settings = {**NATIVE, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:200", "max_split_size": 200 * MIB}
    result, _ = _measure(FakeCuda(settings), monkeypatch)
    assert spy[0]["max_split_size_mb"] == 200
    assert result["sim_max_split_size_mb"] == 200


def test_settings_the_model_lacks_leave_sim_empty_with_the_reason(monkeypatch, spy):
    settings = {
        **NATIVE,
        "PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4",
        "roundup_power2_divisions": {str(1 << i): 4 for i in range(16)},
    }
    result, _ = _measure(FakeCuda(settings), monkeypatch)
    assert spy == []
    assert "sim_peak_reserved_bytes" not in result
    assert "roundup_power2_divisions" in result["sim_skipped_reason"]
    assert result["segment_allocs_measured"] == 1  # the measured side is still counted


def test_async_backend_records_no_history_and_says_why(monkeypatch, spy):
    fake = FakeCuda(backend="cudaMallocAsync")
    fake.install(monkeypatch, history=False)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: pytest.fail("recordHistory raises")
    )
    peak.start_cuda_history()  # under cudaMallocAsync: nothing (its recordHistory raises)
    assert peak._cuda_history is False
    result, _ = _measure(fake, monkeypatch, history=False)
    assert spy == [] and "_snapshot" not in fake.calls
    assert "cudaMallocAsync" in result["sim_skipped_reason"]
    assert result["allocator_backend"] == "cudaMallocAsync"


def test_a_trace_the_model_refuses_does_not_crash_the_point(monkeypatch):
    bad = [_ev("free_completed", 0xDEAD_0000, 512, 10)]  # never allocated, not in the start state
    result, _ = _measure(FakeCuda(window=bad), monkeypatch)
    assert result["peak_reserved_bytes"] == 50 * MIB
    assert "refuses" in result["sim_skipped_reason"]
    assert "sim_peak_reserved_bytes" not in result


def test_retries_and_ooms_are_the_timed_windows_not_the_process(monkeypatch):
    stats = [
        {"num_alloc_retries": 5, "num_ooms": 1},  # from the process's start to the window
        {"num_alloc_retries": 7, "num_ooms": 1, "reserved_bytes.all.peak": 50 * MIB},
    ]
    fake = FakeCuda(stats=stats)
    result, _ = _measure(fake, monkeypatch)
    assert (result["num_alloc_retries"], result["num_ooms"]) == (2, 0)
    assert "reset_accumulated" not in fake.calls  # deltas: the other accumulated counts are left alone
    # Read before the peaks are reset, and after the window's last synchronize.
    assert fake.calls.index("memory_stats") < fake.calls.index("reset_peak_memory_stats")


def test_window_start_survives_a_ring_that_dropped_its_oldest_events():
    mark = history_mark(BEFORE)
    assert window_start(BEFORE + WINDOW, mark) == len(BEFORE)
    assert window_start(BEFORE[2:] + WINDOW, mark) == 2  # two events dropped from the front
    assert window_start(WINDOW, mark) is None  # the window's start itself was overwritten


def test_env_var_precedence_is_torchs():
    both = {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64",
    }
    # torch 2.13's AcceleratorAllocatorConfig::instance parses the first set of CUDA, HIP, ALLOC.
    assert alloc_conf_from_env(both) == ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "x:1"}) == ("PYTORCH_ALLOC_CONF", "x:1")

    def settings(conf):
        return replay_settings(backend="native", snapshot_settings=None, conf=conf)

    rs = settings(both["PYTORCH_CUDA_ALLOC_CONF"])
    assert (rs.expandable_segments, rs.max_split_size_mb, rs.skipped) == (False, 64.0, None)
    assert "garbage_collection_threshold" in settings("garbage_collection_threshold:0.6").skipped
    assert "max_non_split_rounding_mb" in settings("max_split_size_mb:64,max_non_split_rounding_mb:4").skipped
    assert settings("pinned_use_cuda_host_register:True,expandable_segments:True").skipped is None
    assert settings("roundup_power2_divisions:[256:1,>:4],expandable_segments:True").skipped.endswith(
        "roundup_power2_divisions"
    )


def test_environment_reads_the_versions_without_initialising_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA initialised in the supervisor")

    for name in ("_lazy_init", "init", "is_available", "device_count", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    env = environment()
    for key in ("env_cuda_version", "env_cudnn_version", "env_nccl_version", "env_driver_version"):
        assert key in env
    assert env["env_cuda_version"] == torch.version.cuda


def test_the_record_carries_the_ranks_settings_segments_and_versions():
    s = spec("tiny")
    rank = {
        "rank": 0,
        "peak_allocated_bytes": 10,
        "memory_method": "cuda_caching_allocator",
        "step_time_s": 1.0,
        "step_times_s": [1.0],
        "losses": [1.0],
        "allocator_backend": "native",
        "allocator_settings": "expandable_segments:True",
        "sim_peak_reserved_bytes": 20,
        "sim_peak_allocated_bytes": 10,
        "sim_fragmentation_bytes": 10,
        "sim_segments_opened": 3,
        "segment_allocs_measured": 4,
        "env_cudnn_version": 90100,
        "env_nccl_version": "2.21.5",
    }
    row = finish_record(
        s, [rank], status="ok", error=None, error_rank=None, exit_code=0, wall_s=1.0, device_name="cpu"
    )
    assert (row["segment_allocs_measured"], row["sim_segments_opened"]) == (4, 3)
    assert row["allocator_settings"] == "expandable_segments:True"
    assert (row["env_cudnn_version"], row["env_nccl_version"]) == (90100, "2.21.5")
    assert row["sim_skipped_reason"] is None
