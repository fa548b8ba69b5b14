"""The CPU peak counts every byte the step holds: what was alive before it and what C++ code allocates."""

from __future__ import annotations

import pytest
from conftest import in_fresh_process, spec

from harness.estimate.params import stage_params
from harness.runner.supervisor import run_point

MIB = 2**20


def _adamw_steps(model, x):
    """A foreach AdamW over ``model`` and a training step on ``x``, run once so that the optimizer's state
    exists: (the optimizer, the step)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), foreach=True)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return opt, step


def _peaks_with_and_without_a_held_tensor() -> list[dict]:
    import torch

    from harness.runner.measure.peak import PeakMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt, step = _adamw_steps(model, torch.randn(64, 256))  # AdamW's state exists from here on
    out = []
    for held_mib in (0, 4):
        held = torch.ones(held_mib * MIB // 4)  # alive through the step, known to no module or optimizer
        memory = PeakMemory([model], opt, torch.device("cpu"))
        with memory.measure():
            step()
        out.append(memory.result())
        del held
    return out


def test_cpu_peak_includes_storage_alive_before_the_step():
    without, with_held = in_fresh_process(_peaks_with_and_without_a_held_tensor)
    assert with_held["memory_method"] == "cpu_allocator"
    # Everything alive at the start counts, exactly once: the held 4 MiB and nothing else changes.
    assert with_held["peak_allocated_bytes"] - without["peak_allocated_bytes"] == 4 * MIB
    assert with_held["tracker_peak_bytes"] - without["tracker_peak_bytes"] == 4 * MIB
    assert with_held["categories"]["other"] >= 4 * MIB
    # Here nothing but a few scalars is allocated out of the tracker's sight: the two counts agree.
    assert without["peak_allocated_bytes"] == pytest.approx(without["tracker_peak_bytes"], abs=1024)


def test_zero1_peak_holds_half_the_optimizer_state_of_zero0():
    """DDP (ZeRO-0) and DDP + ZeroRedundancyOptimizer (ZeRO-1) on 2 ranks differ by exactly the half of
    AdamW's 8 B per parameter that ZeRO-1 does not keep. Before the measurement tracked the
    ZeroRedundancyOptimizer's local state, ZeRO-1's peak lacked the whole state (a difference of 8n)."""
    peaks = {}
    for zero in (0, 1):
        s = spec("tiny", parallel_dp=2, parallel_zero_stage=zero, train_precision="fp32", train_steps=2)
        record = run_point(s, timeout_s=240)
        assert record["status"] == "ok", record["error"]
        assert record["memory_method"] == "cpu_allocator"
        peaks[zero] = record["peak_allocated_bytes"]
    n = stage_params(s.model, stage=0, pp=1, tp=1)
    assert peaks[0] - peaks[1] == pytest.approx(4 * n, rel=0.02)


def test_pipeline_rank_holds_its_stage_not_the_whole_model():
    """What a pipeline rank holds before its step is its receive buffers and token ids. The worker once
    kept the whole model alive beside the stage copies (4 B per parameter of every layer: +7.2 MiB on
    tiny), which the allocator count rightly charged to the rank."""
    from harness.estimate import estimate

    s = spec("tiny", parallel_pp=2, train_num_microbatches=2, train_precision="fp32", train_steps=2)
    record = run_point(s, timeout_s=240)
    assert record["status"] == "ok", record["error"]
    worst = estimate(s, engine="torch").stages[int(record["worst_rank"])].terms
    before_step = worst["pp_p2p"] + worst["token_ids"]
    assert record["mem_other_bytes"] <= before_step + 64 * 1024
    n = stage_params(s.model, stage=0, pp=1, tp=1)
    assert record["mem_other_bytes"] < 4 * n / 4


def _blocks_freed_elsewhere() -> dict:
    """Two profiled steps in one process: the first leaves a block that is freed after it ends; in the
    second, blocks made on the main thread are freed on another thread."""
    import threading

    import torch

    from harness.runner.measure.cpu import _AllocatorPeak

    with _AllocatorPeak():
        leftover = torch.empty(8 * MIB, dtype=torch.uint8)
    del leftover  # freed while no profiler runs: c10's running total keeps it
    held = []
    with _AllocatorPeak() as peak:
        for _ in range(3):
            held.append(torch.empty(2 * MIB, dtype=torch.uint8))
            t = threading.Thread(target=held.clear)  # the last reference dies on another thread
            t.start()
            t.join()
        last = torch.empty(MIB, dtype=torch.uint8)
    del last
    return {"peak": peak.peak_bytes}


def test_cpu_peak_ignores_earlier_profiles_and_sees_frees_on_other_threads():
    # The old instrument read 8 MiB (the first profile's leftover) + 3 x 2 MiB (blocks it never saw
    # freed) + 1 MiB = 15 MiB here; the step never held more than 2 MiB.
    out = in_fresh_process(_blocks_freed_elsewhere)
    assert out["peak"] == 2 * MIB


def test_profiler_events_go_back_in_the_order_the_running_total_says():
    from harness.runner.measure.trace import _order_by_total

    # (time, index, ptr, size, total, event): a free of 10 recorded 1 ms late, after an allocation the
    # total shows came later, goes back before it; so the step's starting total is read right.
    found = [(0, 0, 10, 100, 100, None), (2, 1, 20, 100, 100, None), (1, 2, 10, -100, 0, None)]
    found.sort(key=lambda e: e[:2])
    _order_by_total(found)
    assert [(e[2], e[3]) for e in found] == [(10, 100), (10, -100), (20, 100)]


def test_ddp_holds_one_set_of_gradient_buckets_at_its_peak():
    # DDP's reducer rebuilds its buckets in the second step's forward and frees the first set. Counted
    # from the measured step's start, the first set looked alive throughout (tiny, dp 2, sequence 512:
    # 83.3 MB read, 7.1 MB of it "untracked", against 76.1 MB held); counted from the rank's start, the
    # allocator's peak, MemTracker's and the replayed trace agree.
    s = spec("tiny", train_precision="fp32", train_seq_len=512, parallel_dp=2, parallel_zero_stage=0)
    r = run_point(s, timeout_s=240)
    assert r["status"] == "ok", r["error"]
    assert r["mem_untracked_bytes"] == 0
    assert r["peak_allocated_bytes"] == pytest.approx(r["tracker_peak_bytes"], abs=64)
    assert r["sim_peak_allocated_bytes"] == pytest.approx(r["peak_allocated_bytes"], rel=0.005)


def _tracker_and_mem_tracker_figures() -> list[dict]:
    """One step (forward with a recomputed block, backward, AdamW) after a warm-up step, counted by the
    harness's Tracker and by PyTorch's own MemTracker: current and peak snapshots by category."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint

    from harness.runner.measure.tracker import _tracker_class

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(128, 256)
            # wide, so that the step's peak comes while its recomputed tensors are alive
            self.recomputed = torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
            )
            self.last = torch.nn.Linear(256, 128)

        def forward(self, x):
            h = self.first(x)
            h = checkpoint(self.recomputed, h, use_reentrant=False)
            return self.last(torch.relu(h))

    model = Net()
    opt, step = _adamw_steps(model, torch.randn(1024, 128))  # AdamW's state exists from here on
    out, cpu = [], torch.device("cpu")
    for tracker in (_tracker_class()(), MemTracker()):
        tracker.track_external(model, opt)
        with tracker:
            step()
        per_module = sum(len(stats.snapshots) for stats in tracker.memory_tracking.values())
        current, peak = tracker.get_tracker_snapshot()[cpu], tracker.get_tracker_snapshot("peak")[cpu]
        out.append(
            {
                "current": {getattr(k, "value", k): v for k, v in current.items()},
                "peak": {getattr(k, "value", k): v for k, v in peak.items()},
                "module_snapshots": per_module,
            }
        )
    return out


def test_tracker_counts_what_mem_tracker_counts_without_per_module_statistics():
    """The Tracker drops MemTracker's per-module bookkeeping (a walk of every module after every
    operator, and snapshot copies in each module hook) and keeps the global figures: the current and
    peak totals and every category of the peak snapshot, recomputation included (a recomputed block's
    tensors are activations, not temporaries), must equal MemTracker's own."""
    ours, theirs = in_fresh_process(_tracker_and_mem_tracker_figures)
    assert ours["peak"] == theirs["peak"]
    assert ours["current"] == theirs["current"]
    # Not a trivial equality: the peak (in backward) holds parameters, optimizer state, activations and
    # temporaries.
    assert all(ours["peak"][c] > 0 for c in ("Parameter", "Optstate", "Activation", "Temp"))
    assert theirs["module_snapshots"] > 0 and ours["module_snapshots"] == 0


def _leaf_input_storage_uses() -> tuple[int, int, int]:
    """Tensors sharing a base's storage: alone, with a leaf view of it fed to a tracked module, and
    after that view is deleted (in a fresh process: a matmul here would leave OpenMP threads in the
    test process, and a rank forked from it later hangs in libgomp)."""
    import torch
    from torch import nn

    from harness.runner.measure.tracker import _tracker_class

    def uses(t: torch.Tensor) -> int:  # tensors sharing t's storage (a view counts one)
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    lin = nn.Linear(16, 16)
    tracker = _tracker_class()()
    tracker.track_external(lin)
    with tracker:
        base = torch.randn(64, 16)
        alone = uses(base)
        x = base[:32].requires_grad_()  # a leaf view, as the loss's slices are
        lin(x).sum().backward()
        held = uses(base)
        del x
        return alone, held, uses(base)


def test_the_tracker_lets_a_leaf_input_go_after_its_backward():
    """A module's input that is a leaf and not a parameter (a slice of the chunked loss, a view of the
    whole hidden states) must not outlive its backward because the tracker watched it: ModTracker's
    input hook keeps the leaf's grad accumulator, which holds the leaf, in a cycle through C++
    (``tracker._input_hooks_released``). Before the fix the slice's view kept the whole base
    allocated: every micro-batch's hidden states stayed to the end of a tracked step."""
    alone, held, after = in_fresh_process(_leaf_input_storage_uses)
    assert held == alone + 1
    assert after == alone
