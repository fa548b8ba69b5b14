"""Every failure mode, injected for real into real workers, yields exactly one record with the right
status within its timeout, and leaves no process behind."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import spec

from harness.runner import worker
from harness.runner.procs import Terminated, free_port
from harness.runner.record import STATUSES
from harness.runner.supervisor import Task
from harness.runner.supervisor import run_point as _run_point
from harness.sweep.progress import leftover_points

FAST = dict(train_precision="fp32", train_seq_len=32, train_steps=2)


def run_point(*args, **kwargs) -> dict:
    record = _run_point(*args, **kwargs)
    assert record["status"] in STATUSES
    return record


def children() -> set[int]:
    """Live (non-zombie) child processes of this test process."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(me) and not fields.get("State", "").startswith("Z"):
            out.add(int(entry.name))
    return out


@pytest.fixture
def no_leftovers():
    before = children()
    yield
    assert children() - before == set()


def inject(monkeypatch, action):
    """Make rank 1's training step do ``action`` instead (rank 0 proceeds and waits for it)."""
    real = worker.train_step

    def step(par, tokens, targets, **kw):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            action()
        return real(par, tokens, targets, **kw)

    monkeypatch.setattr(worker, "train_step", step)


def test_ok_point(no_leftovers):
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=60)
    assert r["status"] == "ok" and r["error"] is None
    assert len(r["per_rank_peak_bytes"]) == 2 and r["peak_allocated_bytes"] == max(r["per_rank_peak_bytes"])
    for field in (
        "step_time_s",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "loss",
        "schema_version",
        "config_id",
        "env_torch_version",
        "est_total_bytes",
        "model_flops_per_step",
    ):
        assert r[field] is not None, field
    # train.steps 2 = 1 warm-up + 1 timed step: the slowest rank's one time, whose spread is undefined
    assert len(r["step_times_s"]) == 1 and r["step_times_s"][0] == r["step_time_s"]
    assert r["step_time_rank"] in (0, 1) and math.isnan(r["step_time_spread"])


def test_rank_that_raises(monkeypatch, no_leftovers):
    def boom():
        raise ValueError("injected failure")

    inject(monkeypatch, boom)
    start = time.monotonic()
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=60)
    assert r["status"] == "crash"
    assert r["error_rank"] == 1 and r["error"] == "ValueError: injected failure"
    assert r["exit_code"] == 1
    assert time.monotonic() - start < 60


def test_rank_killed_with_sigkill(monkeypatch, no_leftovers):
    inject(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGKILL))
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=60)
    assert r["status"] == "crash"
    assert r["error_rank"] == 1 and r["error"] == "rank 1 killed by signal SIGKILL"
    assert r["exit_code"] == -signal.SIGKILL


def test_a_rank_that_aborts_says_where_from_its_log(monkeypatch, no_leftovers):
    """A C++ abort (gloo's, autograd's) leaves no report: the rank's log holds the Python frame that
    took it, and the record says it (seen in CI: a bare "rank 0 killed by signal SIGABRT")."""
    inject(monkeypatch, os.abort)
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=60)
    assert r["status"] == "crash" and r["error_rank"] == 1, r["error"]
    assert r["error"].startswith("rank 1 killed by signal SIGABRT (in File "), r["error"]
    assert "test_supervisor.py" in r["error"] and "teardown" not in r["error"], r["error"]


def test_an_abort_after_the_report_is_told_apart(monkeypatch, no_leftovers):
    monkeypatch.setattr(worker, "_destroy_process_group", os.abort)
    r = run_point(spec("tiny", **FAST), timeout_s=60)
    assert r["status"] == "crash" and r["exit_code"] == -signal.SIGABRT
    assert r["error"].endswith("after it had reported its results (in the process group's teardown)")


@pytest.mark.slow  # 15 s; test_a_hung_rank_is_a_timeout_that_names_it covers a hung rank by default
def test_rank_that_blocks_forever(monkeypatch, no_leftovers):
    inject(monkeypatch, lambda: time.sleep(10_000))
    start = time.monotonic()
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=20)
    elapsed = time.monotonic() - start
    # Rank 0's collective times out first (the process group's timeout is set below the point's) or
    # the supervisor kills both: either way one timeout record, within the timeout plus reaping, and
    # when rank 0 did report, the rank named is the hung one (issue 12: it was rank 0's "crash").
    assert r["status"] == "timeout", r["error"]
    assert elapsed < 20 + 15
    assert r["error_rank"] in (1, None)
    if r["error_rank"] == 1:
        assert r["error"].startswith("rank 1 never arrived") and "imed out" in r["error"]


def test_sigterm_reaps_every_rank_and_records_nothing(monkeypatch, no_leftovers):
    """``kill`` of a sweep or a run mid-point: its ranks go with it (they outlived it before), no record
    (the point has no outcome: a resumed sweep runs it again), and SIGTERM's default action is back."""
    inject(monkeypatch, lambda: time.sleep(10_000))
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    with pytest.raises(Terminated):
        run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=120)
    assert time.monotonic() - start < 30
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sigterm_to_a_rank_records_nothing(monkeypatch, no_leftovers):
    """``kill`` of a sweep's whole process group reaches its ranks too, and a rank can end before the
    supervisor sees the signal. That rank's "Terminated: SIGTERM" was written as a ``crash`` row, which a
    resumed sweep never ran again; the point has no outcome, so there is no row, as above."""
    inject(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))  # rank 1 alone is signalled
    with pytest.raises(Terminated, match="rank 1"):
        run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=120)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_impossible_layout_starts_nothing(no_leftovers):
    def never(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("a process was started for an invalid point")

    r = run_point(_invalid(), timeout_s=10, rank_fn=never)
    assert r["status"] == "invalid"
    assert "num_heads 4 % tp 3 = 1 ≠ 0" in r["error"]
    assert r["config_id"].startswith("x")


def _invalid():
    import dataclasses

    s = spec("tiny", **FAST)
    return dataclasses.replace(s, parallel=dataclasses.replace(s.parallel, tp=3, world_size=None))


def test_simulated_out_of_memory_keeps_the_peak(no_leftovers):
    import dataclasses

    s = spec("tiny", **FAST)
    small = dataclasses.replace(s, device=dataclasses.replace(s.device, memory_gib=0.001))
    r = run_point(small, timeout_s=60)
    assert r["status"] == "oom" and r["oom_source"] == "simulated"
    assert r["peak_allocated_bytes"] > small.device.memory_bytes
    assert "simulated: peak" in r["error"]


def test_gpu_device_without_cuda_is_invalid(no_leftovers):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run_point(spec("tiny", "h100_80gb", **FAST), timeout_s=10)
    assert r["status"] == "invalid" and "needs CUDA" in r["error"]


def test_pipeline_with_sharded_optimizer_is_refused_before_launch(no_leftovers):
    def never(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("a process was started")

    s = spec("tiny", parallel_dp=2, parallel_pp=2, parallel_zero_stage=1, train_num_microbatches=2, **FAST)
    r = run_point(s, timeout_s=10, rank_fn=never)
    assert r["status"] == "invalid" and "use zero_stage 0, 2 or 3" in r["error"]


def test_straggler_killed_after_a_failure_is_not_blamed(monkeypatch, no_leftovers):
    # Rank 1 raises; rank 0 is stuck (not in a collective that would notice): the supervisor kills it
    # after its grace period, and the record still names rank 1 and its error.
    import harness.runner.supervisor as supervisor

    monkeypatch.setattr(supervisor, "GRACE_S", 2.0)
    real = worker.train_step

    def step(par, tokens, targets, **kw):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("injected on rank 1")
        time.sleep(10_000)
        return real(par, tokens, targets, **kw)

    monkeypatch.setattr(worker, "train_step", step)
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=60)
    assert r["status"] == "crash"
    assert r["error_rank"] == 1 and r["error"] == "RuntimeError: injected on rank 1"


# A point wider than a node: its ranks spread over tasks (one per node under Slurm) that meet at task 0's
# address and share a directory. Here both tasks are processes of this machine; tests/sweep/test_slurm.py runs
# them as the tasks of a real two-node Slurm job.
MULTI = dict(parallel_dp=2, parallel_tp=2, **FAST)


def _other_task(index: int, count: int, port: int, shared: Path, timeout_s: float):
    import multiprocessing

    task = Task(index=index, count=count, port=port, shared_dir=shared)
    proc = multiprocessing.get_context("fork").Process(
        target=_run_point, args=(spec("tiny", **MULTI),), kwargs={"timeout_s": timeout_s, "task": task}
    )
    proc.start()
    return proc


def test_a_point_spread_over_two_tasks_is_the_same_run(tmp_path, no_leftovers):
    alone = run_point(spec("tiny", **MULTI), timeout_s=60)
    port, shared = free_port(), tmp_path / "point"
    other = _other_task(1, 2, port, shared, 60)
    r = run_point(spec("tiny", **MULTI), timeout_s=60, task=Task(0, 2, port=port, shared_dir=shared))
    other.join(30)
    assert other.exitcode == 0
    assert r["status"] == "ok" and alone["status"] == "ok"
    assert r["launch_tasks"] == 2 and alone["launch_tasks"] == 1 and len(r["launch_hosts"]) == 2
    # Same ranks, same data, same reduction order: the same losses (fp32).
    assert r["losses"] == pytest.approx(alone["losses"], rel=1e-6)
    assert len(r["per_rank_peak_bytes"]) == 4 and None not in r["per_rank_peak_bytes"]
    assert not shared.exists()  # every task reported: the shared directory is removed


def test_a_failure_on_another_task_is_blamed_on_its_rank(monkeypatch, tmp_path, no_leftovers):
    import harness.runner.supervisor as supervisor

    monkeypatch.setattr(supervisor, "GRACE_S", 3.0)
    real = worker.train_step

    def step(par, tokens, targets, **kw):
        import torch.distributed as dist

        if dist.get_rank() == 3:  # on task 1
            raise RuntimeError("injected on rank 3")
        return real(par, tokens, targets, **kw)

    monkeypatch.setattr(worker, "train_step", step)
    port, shared = free_port(), tmp_path / "point"
    other = _other_task(1, 2, port, shared, 60)
    start = time.monotonic()
    r = run_point(spec("tiny", **MULTI), timeout_s=60, task=Task(0, 2, port=port, shared_dir=shared))
    other.join(30)
    assert r["status"] == "crash"
    assert r["error_rank"] == 3 and r["error"] == "RuntimeError: injected on rank 3"
    assert time.monotonic() - start < 50  # ended by the failure, not by the timeout


def test_a_task_that_never_reports_is_a_crash_row(monkeypatch, tmp_path, no_leftovers):
    # Task 1 (a lost node) never starts: task 0's ranks wait for it in the rendezvous until the
    # timeout, and the record names the ranks that never reported, not task 0's broken collectives.
    import harness.runner.supervisor as supervisor

    monkeypatch.setattr(supervisor, "GRACE_S", 1.0)
    monkeypatch.setattr(supervisor, "PEER_MARGIN_S", 0.0)
    shared = tmp_path / ".points" / "point-1"  # as harness.sweep.slurm_task names it under results_dir
    r = run_point(spec("tiny", **MULTI), timeout_s=12, task=Task(0, 2, port=free_port(), shared_dir=shared))
    assert r["status"] == "crash" and r["error_rank"] == 2
    assert r["error"].startswith("ranks 2-3 never reported") and "1 of 2 tasks reported" in r["error"]
    assert (shared / "task0.json").exists()  # kept for the logs of what did run, and said so:
    assert leftover_points(str(tmp_path)).startswith("1 multi-node point directory kept")


def test_ranks_and_their_devices_when_a_point_is_spread_over_tasks():
    # 8 ranks as 2 nodes x 1 task: each task 4 ranks, devices 0-3 of its node.
    assert Task(1, 2).ranks(8) == range(4, 8) and Task(1, 2).placement(8) == (0, 4)
    # 16 ranks as 2 nodes x 4 tasks (two ranks per task): task 5 is the second task of node 1; its
    # ranks 10-11 take devices 2 and 3 of that node, which runs 8 ranks.
    t = Task(index=5, count=4 * 2, tasks_per_node=4, node_task=1)
    assert t.ranks(16) == range(10, 12) and t.placement(16) == (2, 8)
    # One rank per task (submitit's usual way): task k is rank k, device node_task.
    assert Task(index=3, count=8, tasks_per_node=8, node_task=3).placement(8) == (3, 8)
    # More tasks than ranks: the extra tasks have no rank.
    assert Task(3, 4).ranks(2) == range(2, 2)
    # One task: every rank, devices 0..world-1.
    assert Task().ranks(4) == range(4) and Task().placement(4) == (0, 4)


# ------------------------------------------------------------------ issue 12: kills, hangs, host memory


def _fake_rank(behaviour):
    """A rank_fn for the supervisor without torch work: ``behaviour(rank, out_dir)`` then exit 0."""

    def rank_fn(rank, spec, *, out_dir, **kwargs):
        from harness.runner.procs import write_json

        behaviour(rank, out_dir)
        write_json(out_dir / f"rank{rank}.json", {"rank": rank})
        os._exit(0)

    return rank_fn


def _gloo_timeout_on_rank0(rank, out_dir):
    """Rank 0 reports what gloo reports when a peer never arrives; rank 1 hangs."""
    from harness.runner.procs import write_json

    if rank == 1:
        time.sleep(10_000)
    time.sleep(0.2)
    error = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms"
    write_json(out_dir / f"rank{rank}.json", {"rank": rank, "error": error})
    os._exit(1)


def test_a_hung_rank_is_a_timeout_that_names_it(monkeypatch, no_leftovers):
    # Rank 1 hangs; rank 0's collective times out (a symptom) and it exits 1. Before issue 12 this was
    # recorded as rank 0's crash; the record must be a timeout naming rank 1, the one still running.
    import harness.runner.supervisor as supervisor

    monkeypatch.setattr(supervisor, "GRACE_S", 1.0)
    r = run_point(
        spec("tiny", parallel_dp=2, **FAST), timeout_s=30, rank_fn=_fake_rank(_gloo_timeout_on_rank0)
    )
    assert r["status"] == "timeout" and r["error_rank"] == 1
    assert r["error"].startswith("rank 1 never arrived at a collective")
    assert "rank 0's own error is the symptom" in r["error"]


def _host_allocation_fails_on_rank1(rank, out_dir):
    from harness.runner.procs import write_json

    if rank == 1:
        error = (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 4503599627370496 bytes."
        )
        write_json(out_dir / f"rank{rank}.json", {"rank": rank, "error": error, "oom": False})
        os._exit(1)


def _sigkill_on_rank1(rank, out_dir):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_host_out_of_memory_is_oom_from_the_host(monkeypatch, no_leftovers):
    # A failed host allocation (torch raises a RuntimeError, not OutOfMemoryError, on CPU): oom/host.
    r = run_point(
        spec("tiny", parallel_dp=2, **FAST), timeout_s=30, rank_fn=_fake_rank(_host_allocation_fails_on_rank1)
    )
    assert (r["status"], r["oom_source"], r["error_rank"]) == ("oom", "host", 1)
    # A SIGKILL while the kernel's OOM killer count went up (5 -> 6 around the point): oom/host.
    import harness.runner.supervisor as supervisor

    counts = iter([5, 6])
    monkeypatch.setattr(supervisor, "host_oom_kills", lambda: next(counts))
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=30, rank_fn=_fake_rank(_sigkill_on_rank1))
    assert (r["status"], r["oom_source"], r["error_rank"]) == ("oom", "host", 1)
    assert "OOM killer" in r["error"]
    # The same SIGKILL without the OOM killer (3 -> 3) stays a crash.
    counts = iter([3, 3])
    r = run_point(spec("tiny", parallel_dp=2, **FAST), timeout_s=30, rank_fn=_fake_rank(_sigkill_on_rank1))
    assert (r["status"], r["oom_source"]) == ("crash", None)


def _listening_addresses(rank, out_dir):
    """Join a real gloo group, then list the addresses that listen on the point's store port."""
    from datetime import timedelta

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    if rank == 0:
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(f":{port:04X}"):
                    found.append(local.split(":")[0])
        (out_dir / "listening.txt").write_text(" ".join(found))
    dist.barrier()
    dist.destroy_process_group()


def _with_env(behaviour):
    def rank_fn(rank, spec, *, port, out_dir, master_addr, **kwargs):
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port))
        _fake_rank(behaviour)(rank, spec, out_dir=out_dir)

    return rank_fn


def test_single_host_store_listens_on_loopback_only(tmp_path, no_leftovers):
    r = run_point(
        spec("tiny", parallel_dp=2, **FAST),
        timeout_s=60,
        rank_fn=_with_env(_listening_addresses),
        keep_dir=tmp_path,
    )
    assert r["status"] == "ok", r["error"]
    # /proc/net/tcp writes 127.0.0.1 as 0100007F; every interface would be 00000000 (or :: in tcp6).
    assert (tmp_path / "listening.txt").read_text().split() == ["0100007F"]


KILLED_SUPERVISOR = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import spec
from harness.runner.supervisor import run_point

def rank_fn(rank, spec, *, out_dir, **kwargs):
    Path({pids!r}, str(rank)).write_text(str(os.getpid()))
    time.sleep(10_000)

run_point(spec("tiny", parallel_dp=2, train_precision="fp32", train_seq_len=32), timeout_s=10_000,
          rank_fn=rank_fn)
"""


def _running(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def test_ranks_die_with_a_killed_supervisor_and_its_directory_is_cleaned(tmp_path, monkeypatch):
    """``kill -9`` of a supervisor (a run, a sweep): its ranks die within seconds (they lived on,
    re-parented to init, for their whole timeout before issue 12), and the point's temporary
    directory, which it could not remove, goes at the next start of a point."""
    import subprocess
    import sys
    import tempfile

    import harness.runner.supervisor as supervisor

    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    script = KILLED_SUPERVISOR.format(tests=str(Path(__file__).resolve().parents[1]), pids=str(pids))
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [int(p.read_text()) for p in pids.iterdir()]
    assert len(ranks) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in ranks if _running(pid)]
    for pid in survivors:  # (only before the fix: don't leave them behind)
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    point_dirs = list(tmp.glob("harness-point-*"))
    assert len(point_dirs) == 1 and point_dirs[0].name.startswith(f"harness-point-{proc.pid}-")
    # The next start cleans the dead supervisor's directory, and leaves a live one's alone.
    live = tmp / f"harness-point-{os.getpid()}-x"
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert supervisor.clean_leftover_point_dirs() == [str(point_dirs[0])]
    assert not point_dirs[0].exists() and live.exists()
