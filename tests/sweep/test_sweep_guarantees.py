"""What a sweep guarantees under concurrency, kills and foreign files (issue 12): each point at most
once at a time (claims), every launched point one row, unreadable rows run again, failed rows retried
on request, hopeless points never launched, and one-line errors (exit 2) that lose nothing."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import harness_cli, spec

from harness.cli.config import compose
from harness.sweep import claims
from harness.sweep.launch import point_id, run_job, triage
from harness.sweep.progress import closing_summary
from harness.sweep.store import load_results, record_path, result_files, write_record

POINT = ["+study=cpu_smoke", "parallel.dp=1", "parallel.tp=1", "parallel.zero_stage=0", "train.seq_len=32"]


def config(tmp_path, *overrides) -> dict:
    return compose([*POINT, f"results_dir={tmp_path}", "sweep.name=t", *overrides])


def row(cfg, status: str) -> dict:
    return {"config_id": point_id(cfg), "status": status, "sweep_name": "t"}


# ------------------------------------------------------------------------------------------- claims


def test_a_point_held_by_another_live_sweep_is_not_launched_and_that_is_said(tmp_path):
    cfg = config(tmp_path)
    # Another sweep on this host, alive (this very process, under another token), holds the point.
    assert claims.try_claim(tmp_path, point_id(cfg), "other-sweep") == (True, None)
    launch, summary = triage(["p"], [cfg], token="this-sweep")
    assert launch == []
    assert "1 held by another live sweep (skipped)" in summary
    assert f"another sweep is running 1 of these points ({claims._host()} pid {os.getpid()})" in summary
    # Its own sweep's jobs run under it; once released, the point is free.
    assert claims.try_claim(tmp_path, point_id(cfg), "other-sweep") == (True, None)
    claims.release(tmp_path, point_id(cfg), "other-sweep")
    launch, summary = triage(["p"], [cfg], token="this-sweep")
    assert [p for p, _ in launch] == ["p"] and "1 to launch" in summary
    claims.release_all("this-sweep")
    assert not claims.claim_path(tmp_path, point_id(cfg)).exists()


def test_a_dead_or_silent_claimer_loses_its_claim(tmp_path):
    path = claims.claim_path(tmp_path, "abc")
    path.parent.mkdir(parents=True)
    # A claimer on this host whose process is gone (a finished child's pid): taken over at once.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = {"host": claims._host(), "pid": int(dead.stdout), "token": "gone"}
    path.write_text(json.dumps(stale))
    assert claims.try_claim(tmp_path, "abc", "mine") == (True, None)
    assert json.loads(path.read_text())["token"] == "mine"
    # A claimer on another host (an NFS peer) is alive while its heartbeat is recent...
    path.write_text(json.dumps({"host": "node-17", "pid": 1, "token": "far"}))
    held, info = claims.try_claim(tmp_path, "abc", "mine")
    assert not held and claims.describe(info) == "node-17 pid 1"
    # ...and expired once the heartbeat is EXPIRE_S old (nothing touched the file for that long).
    old = time.time() - claims.EXPIRE_S - 1
    os.utime(path, (old, old))
    assert claims.try_claim(tmp_path, "abc", "mine") == (True, None)
    claims.release(tmp_path, "abc", "mine")
    # Releasing never removes another sweep's claim.
    path.write_text(json.dumps({"host": "node-17", "pid": 1, "token": "far"}))
    claims.release(tmp_path, "abc", "mine")
    assert path.exists()


def test_a_claim_dated_far_ahead_does_not_block_its_point(tmp_path):
    # Issue 29: another host's claim dated in the future (clock skew, a touched file) blocked its
    # point until that date. Within EXPIRE_S ahead it is a live heartbeat; beyond, it is not.
    path = claims.claim_path(tmp_path, "abc")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "node-17", "pid": 1, "token": "far"}))
    near = time.time() + claims.EXPIRE_S / 2
    os.utime(path, (near, near))
    assert claims.try_claim(tmp_path, "abc", "mine")[0] is False
    ahead = time.time() + 3600
    os.utime(path, (ahead, ahead))
    assert claims.try_claim(tmp_path, "abc", "mine") == (True, None)
    claims.release(tmp_path, "abc", "mine")


def test_the_heartbeat_keeps_a_held_claim_alive_and_no_other(tmp_path):
    assert claims.try_claim(tmp_path, "mine", "t") == (True, None)
    assert claims.try_claim(tmp_path, "given-up", "t") == (True, None)
    old = time.time() - 60
    for name in ("mine", "given-up"):
        os.utime(claims.claim_path(tmp_path, name), (old, old))
    # another sweep took "given-up" over meanwhile: this process must not keep it alive
    claims.claim_path(tmp_path, "given-up").write_text(
        json.dumps({"host": "node-17", "pid": 1, "token": "x"})
    )
    os.utime(claims.claim_path(tmp_path, "given-up"), (old, old))
    claims.beat()
    assert claims.read_claim(claims.claim_path(tmp_path, "mine"))[1] < 5
    assert claims.read_claim(claims.claim_path(tmp_path, "given-up"))[1] > 59
    claims.release_all("t")
    assert (
        not claims.claim_path(tmp_path, "mine").exists() and claims.claim_path(tmp_path, "given-up").exists()
    )


def test_a_stopped_sweeps_claim_on_this_host_is_live_whatever_its_age(tmp_path):
    # issue 29: a sweep stopped with Ctrl-Z for over EXPIRE_S sends no heartbeat; its process is alive,
    # so its points stay its own (before, a second sweep took them and the point ran twice).
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = claims.claim_path(tmp_path, "abc")
        path.parent.mkdir(parents=True)
        start = claims.process_start(stopped.pid)
        assert start is not None
        info = {"host": claims._host(), "pid": stopped.pid, "pid_start": start, "token": "stopped"}
        path.write_text(json.dumps(info))
        old = time.time() - 10 * claims.EXPIRE_S
        os.utime(path, (old, old))
        held, holder = claims.try_claim(tmp_path, "abc", "second")
        assert not held and holder["token"] == "stopped"
        # The same pid with another start time is another process (the pid was reused): not live.
        path.write_text(json.dumps({**info, "pid_start": str(int(start) + 1)}))
        assert claims.try_claim(tmp_path, "abc", "second") == (True, None)
        claims.release(tmp_path, "abc", "second")
    finally:
        stopped.kill()
        stopped.wait()


def test_a_job_whose_claim_was_taken_over_discards_its_result(tmp_path, capsys, monkeypatch):
    # The first sweep resumed after another took its point over and wrote ok: its late result must
    # not overwrite that row (issue 29: a false timeout over the second's ok).
    cfg = config(tmp_path, "++sweep.claim=first")
    cid = point_id(cfg)

    def taken_over(spec, **kwargs):
        write_record(row(cfg, "ok"), tmp_path)  # the other sweep's row ...
        claims.claim_path(tmp_path, cid).write_text(  # ... under its claim
            json.dumps({"host": "node-17", "pid": 1, "token": "second"})
        )
        return {**row(cfg, "timeout"), "error": "late"}

    monkeypatch.setattr("harness.runner.supervisor.run_point", taken_over)
    assert run_job(cfg) == "discarded: claim lost"
    assert "this result (timeout) is discarded" in capsys.readouterr().out
    assert pq.read_table(record_path(tmp_path, cid)).column("status").to_pylist() == ["ok"]
    claims.claim_path(tmp_path, cid).unlink()


def test_a_job_skips_a_point_another_sweep_holds(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path, "++sweep.claim=mine")
    assert claims.try_claim(tmp_path, point_id(cfg), "theirs")[0]

    def never(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("a held point was run")

    monkeypatch.setattr("harness.runner.supervisor.run_point", never)
    assert run_job(cfg) == "held by another sweep"
    assert "is being run by another sweep" in capsys.readouterr().out
    assert result_files(tmp_path) == []
    claims.release(tmp_path, point_id(cfg), "theirs")


@pytest.mark.slow
def test_two_sweeps_on_one_directory_run_each_point_once(tmp_path):
    """Both sweeps start together on the same two points: each point runs once, in one of them."""
    args = [*POINT[:-3], "parallel.tp=1,2", "parallel.zero_stage=0", "train.seq_len=32"]
    cmd = [sys.executable, "-m", "harness", "sweep", *args, f"results_dir={tmp_path}", "sweep.name=t"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = sum(out.count("] ok dp=1") for out in outs)
    assert runs == 2, outs
    assert any("held by another live sweep" in out or "already done" in out for out in outs), outs
    frame, bad = load_results(tmp_path)
    assert bad == [] and sorted(frame["parallel_tp"]) == [1, 2]
    assert not list((tmp_path / ".claims").iterdir())  # every claim released


# -------------------------------------------------------------------------------------- rows, retry


def test_a_truncated_row_runs_again(tmp_path, capsys):
    cfg = config(tmp_path)
    path = write_record(row(cfg, "ok"), tmp_path)
    path.write_bytes(path.read_bytes()[:64])  # before issue 12: "1 already done", never run again
    launch, summary = triage(["p"], [cfg], token="t")
    claims.release_all("t")
    assert [p for p, _ in launch] == ["p"] and "1 to launch" in summary
    assert (tmp_path / f"{path.name}.corrupt").exists() and "moved aside" in capsys.readouterr().err


def test_retry_reruns_the_rows_of_the_statuses_named(tmp_path):
    cfg = config(tmp_path)
    write_record(row(cfg, "timeout"), tmp_path)
    assert "1 already done" in triage(["p"], [cfg], write=False)[1]
    launch, summary = triage(["p"], [config(tmp_path, "sweep.retry=[timeout,crash]")], write=False)
    assert [p for p, _ in launch] == ["p"] and "1 to rerun (sweep.retry)" in summary
    launch, summary = triage(["p"], [config(tmp_path, "sweep.retry=[crash]")], write=False)
    assert launch == [] and "1 already done" in summary


@pytest.mark.slow
def test_retry_from_the_command_line_replaces_the_row(tmp_path):
    cfg = config(tmp_path)
    write_record(row(cfg, "timeout"), tmp_path)
    r = harness_cli("sweep", *POINT, f"results_dir={tmp_path}", "sweep.name=t", "sweep.retry=timeout,crash")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 points: 1 to rerun (sweep.retry)" in r.stdout and "[1/1] ok" in r.stdout
    assert "[HYDRA]" not in r.stdout + r.stderr  # Hydra's own log lines are quiet (issue 16)
    assert "harness sweep: done: 1 points: ok 1" in r.stdout
    assert pq.read_table(record_path(tmp_path, point_id(cfg)))["status"].to_pylist() == ["ok"]


# ------------------------------------------------------------------------------ hopeless points


def test_a_point_far_beyond_capacity_is_never_launched(tmp_path):
    # tiny model on the 1 GiB cpu device, 10,000 layers of hidden 4096: far beyond 16x the device.
    huge = config(tmp_path, "model.hidden_size=4096", "model.ffn_hidden_size=11008", "model.num_layers=10000")
    launch, summary = triage(["p"], [huge], token="t")
    assert launch == [] and "1 skipped, predicted out of memory (row written)" in summary
    frame, _ = load_results(tmp_path)
    assert frame["status"].tolist() == ["skipped_predicted_oom"]
    assert "capacity > 16× (never launched)" in frame["error"][0]


def test_an_estimate_beyond_int64_is_a_row_not_an_overflow(tmp_path):
    # Before issue 12 writing this row aborted the sweep with "OverflowError: Python int too large".
    absurd = config(
        tmp_path,
        "model.hidden_size=4194304",
        "model.ffn_hidden_size=100000000",
        "model.num_layers=60000",  # (65,536 at most since issue 29)
        "train.seq_len=1048576",
        "sweep.prune_predicted_oom=true",
    )
    launch, _ = triage(["p"], [absurd], token="t")
    frame, bad = load_results(tmp_path)
    assert launch == [] and bad == [] and frame["status"].tolist() == ["skipped_predicted_oom"]
    assert frame["est_total_bytes"][0] > 2**63


# ----------------------------------------------------------------------- one-line errors, exit 2


def one_line_error(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_unusable_results_dirs_are_one_line_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    err = one_line_error(harness_cli("sweep", *POINT, f"results_dir={a_file}"))
    assert err == f"harness sweep: error: results_dir={a_file} is a file, not a directory"
    err = one_line_error(harness_cli("sweep", *POINT, "results_dir=/proc/harness-results"))
    assert err.startswith("harness sweep: error: results_dir=/proc/harness-results is not writable")
    missing = tmp_path / "missing"
    err = one_line_error(harness_cli("results", "compact", f"results_dir={missing}"))
    assert err == f"harness results: error: results_dir={missing} is not a directory"
    assert not missing.exists()  # compact used to create it
    # an unusable hydra.sweep.dir was Hydra's traceback after the claims (issue 29); no claim is left
    err = one_line_error(
        harness_cli("sweep", *POINT, f"results_dir={tmp_path / 'r'}", f"hydra.sweep.dir={a_file}/x")
    )
    assert err == f"harness sweep: error: hydra.sweep.dir={a_file}/x: cannot create it (Not a directory)"
    assert not list((tmp_path / "r").glob(".claims/*.claim"))


def test_usage_errors_are_one_line(tmp_path):
    err = one_line_error(harness_cli("sweep", *POINT, f"results_dir={tmp_path}", "parallel.tpp=2"))
    assert err.startswith("harness sweep: error: ") and "parallel.tpp" in err
    err = one_line_error(harness_cli("sweep", *POINT, f"results_dir={tmp_path}", "sweep.retry=oops"))
    assert "unknown status oops" in err
    err = one_line_error(harness_cli("sweep", *POINT, f"results_dir={tmp_path}", "run.timeout_s=inf"))
    assert err == "harness sweep: error: run.timeout_s=inf must be a finite number of seconds > 0"
    assert result_files(tmp_path) == []
    err = one_line_error(harness_cli("run", "run.timeout_s=inf"))
    assert err == "harness run: error: run.timeout_s=inf must be a finite number of seconds > 0"
    err = one_line_error(harness_cli("plan", "plan.top=0"))
    assert err == "harness plan: error: plan.top=0 must be from 1 to 1,000,000,000"


def test_a_full_disk_stops_the_sweep_in_one_line_and_loses_nothing(tmp_path, monkeypatch):
    cfg = config(tmp_path, "++sweep.claim=t")
    earlier = write_record({"config_id": "earlier", "status": "ok"}, tmp_path)
    monkeypatch.setattr(
        "harness.runner.supervisor.run_point", lambda spec, **kw: {"status": "ok", "error": None}
    )

    def full(record, results_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("harness.sweep.launch.write_record", full)
    with pytest.raises(SystemExit) as stop:
        run_job(cfg)
    assert str(stop.value).startswith(
        f"harness sweep: error: cannot write the row of {point_id(cfg)} to {tmp_path}: "
        "No space left on device"
    )
    assert "\n" not in str(stop.value)
    assert load_results(tmp_path)[0]["config_id"].tolist() == ["earlier"] and earlier.exists()
    assert not claims.claim_path(tmp_path, point_id(cfg)).exists()  # its claim released


def test_a_results_dir_that_cannot_take_a_claim_stops_the_sweep_in_one_line(tmp_path, monkeypatch):
    """issue 29 item 5: a results_dir gone full or read-only mid-sweep failed at the claim, before the
    row: Hydra's "Error executing job" and 53 lines; releasing the claim then failed again."""
    cfg = config(tmp_path, "++sweep.claim=t")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(claims, "_write", read_only)
    with pytest.raises(SystemExit) as stop:
        run_job(cfg)
    assert str(stop.value) == (
        f"harness sweep: error: cannot claim {point_id(cfg)} in {tmp_path}: Read-only file system; the "
        "sweep stops (every row written so far is whole: run it again to resume once there is room)"
    )
    assert result_files(tmp_path) == []


def test_a_claim_that_cannot_be_released_leaves_the_stop_line_alone(tmp_path, monkeypatch):
    cfg = config(tmp_path, "++sweep.claim=t")
    monkeypatch.setattr(
        "harness.runner.supervisor.run_point", lambda spec, **kw: {"status": "ok", "error": None}
    )

    def full(record, results_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("harness.sweep.launch.write_record", full)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(SystemExit) as stop:  # the row's error, not the release's
        run_job(cfg)
    assert str(stop.value).startswith(f"harness sweep: error: cannot write the row of {point_id(cfg)}")


def test_a_machine_fault_in_a_rank_is_no_row_and_stops_the_sweep(tmp_path, monkeypatch):
    """issue 29 item 5: a full TMPDIR turned 6 of 8 points into `crash` rows that counted as done. A rank
    that cannot write its report for lack of room exits with HOST_FAULT_EXIT; the supervisor raises
    HostFault, and the sweep stops in one line without a row (run again, the point runs)."""
    import harness.runner.worker as worker
    from harness.runner.procs import HostFault
    from harness.runner.supervisor import run_point

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(worker, "write_json", full)  # inherited by the forked ranks
    with pytest.raises(HostFault, match=r"^rank 0: it could not write its report in .*harness-point-"):
        run_point(spec("tiny", train_precision="fp32", train_seq_len=32, train_steps=2), timeout_s=120)
    cfg = config(tmp_path, "++sweep.claim=t")
    with pytest.raises(SystemExit) as stop:
        run_job(cfg)
    line = str(stop.value)
    assert line.startswith(
        f"harness sweep: error: {point_id(cfg)} not run: this machine failed it, not the point: "
    )
    assert "could not write its report" in line and "\n" not in line
    assert result_files(tmp_path) == []  # no row: the point has no outcome, a rerun runs it
    assert not claims.claim_path(tmp_path, point_id(cfg)).exists()


# ---------------------------------------------------------------------------------- closing lines


def test_the_closing_summary_counts_ratios_and_next_commands(tmp_path):
    base = {"parallel_dp": 1, "parallel_tp": 1, "parallel_pp": 1, "parallel_cp": 1, "parallel_zero_stage": 0}
    write_record(
        {**base, "config_id": "a", "status": "ok", "est_total_bytes": 100, "peak_allocated_bytes": 100},
        tmp_path,
    )
    write_record(
        {
            **base,
            "config_id": "b",
            "status": "ok",
            "est_total_bytes": 50,
            "peak_allocated_bytes": 100,
            "parallel_tp": 2,
        },
        tmp_path,
    )
    write_record({**base, "config_id": "c", "status": "oom"}, tmp_path)
    write_record({**base, "config_id": "other", "status": "crash"}, tmp_path)  # not this sweep's
    text = closing_summary(str(tmp_path), ["a", "b", "c", "d"])
    assert (
        "harness sweep: done: 4 points: ok 2, oom 1, 1 without a row (run the sweep again to resume)" in text
    )
    # the worst ratio first: 50/100 = 0.50 (2x off), then 100/100
    assert "worst predicted/measured peak (torch engine): 0.50 (dp=1 tp=2 pp=1 cp=1 zero=0), 1.00" in text
    assert f"harness calibrate results_dir={tmp_path}" in text and "harness results compact" in text


def test_progress_and_summary_show_the_reserved_level_against_the_card(tmp_path):
    # Issue 31: a sweep showed only the tensors' peak; what decides a GPU run is the allocator's reserve.
    from harness.sweep.progress import progress_line

    base = {
        "parallel_dp": 2,
        "parallel_tp": 1,
        "parallel_pp": 1,
        "parallel_cp": 1,
        "parallel_zero_stage": 3,
        "device_name": "h100_80gb",
    }
    gib = 2**30
    replayed = {
        **base,
        "config_id": "a",
        "status": "ok",
        "device_memory_gib": 80.0,
        "sim_peak_reserved_bytes": 78 * gib,
        "sim_capacity_verdict": "fits_after_flush",
    }
    measured = {
        **base,
        "config_id": "b",
        "status": "ok",
        "device_memory_gib": 80.0,
        "peak_reserved_bytes": 40 * gib,
    }
    line = progress_line(str(tmp_path), replayed, 3.0)
    assert line.endswith("3.0 s, reserved 97.5% of the card (replayed), fits after flush")
    assert progress_line(str(tmp_path), measured, 1.0).endswith("reserved 50.0% of the card (measured)")
    write_record(replayed, tmp_path)
    write_record(measured, tmp_path)
    text = closing_summary(str(tmp_path), ["a", "b"])
    assert "harness sweep: worst reserved / capacity: 97.5% (replayed; dp=2 tp=1 pp=1 cp=1 zero=3)" in text
    cpu = {**measured, "device_name": "cpu"}  # a simulated capacity: nothing to say
    assert progress_line(str(tmp_path), cpu, 1.0).endswith("1.0 s")


@pytest.mark.parametrize("content", ["[1, 2]", '{"name": "x"}', '{"name": 1, "planned": "ab"}', "not json"])
def test_a_malformed_plan_file_is_ignored_not_a_traceback(tmp_path, content):
    # Issue 29: a malformed .sweep-plan.json was a traceback in results status and in every progress line.
    from harness.sweep import progress

    (tmp_path / progress.PLAN_FILE).write_text(content)
    assert progress.read_plan(tmp_path) is None and progress.what_is_left(str(tmp_path)) is None
    line = progress.progress_line(str(tmp_path), {"status": "ok", "parallel_dp": 1}, 1.0)
    assert line.startswith("ok dp=1")
    status = harness_cli("results", "status", f"results_dir={tmp_path}")
    assert status.returncode == 0 and status.stderr == "", status.stderr


def test_a_sweep_that_launches_nothing_leaves_the_running_ones_progress(tmp_path):
    # Issue 29: a second sweep that launched nothing reset the first's count ([1/0] ... [8/0]).
    from harness.sweep import progress

    progress.start_progress(str(tmp_path), name="first", launched=8, planned=["a", "b"])
    progress.progress_line(str(tmp_path), {"status": "ok"}, 1.0)
    progress.start_progress(str(tmp_path), name="second", launched=0, planned=["a", "b"])
    assert progress.read_plan(tmp_path)["name"] == "first"
    assert progress.progress_line(str(tmp_path), {"status": "ok"}, 1.0).startswith("[2/8] ok")


def test_a_path_is_given_as_it_is_in_every_command(tmp_path):
    # Issue 29: a path with a comma, a bracket or a quote had to be quoted for Hydra in most commands
    # and not in `results`; the sweep's closing lines printed it unquoted.
    import shlex

    odd = tmp_path / "it's a [dir], really"
    done = harness_cli("sweep", *POINT, f"results_dir={odd}", "sweep.name=t")
    assert done.returncode == 0, done.stderr
    assert any((odd).glob("*.parquet"))
    assert f"harness results status {shlex.quote(f'results_dir={odd}')}" in done.stdout + done.stderr
    status = harness_cli("results", "status", f"results_dir={odd}")
    assert status.returncode == 0 and "1 runs" in status.stdout, status.stdout + status.stderr
    missing = harness_cli("estimate", "model=tiny", f"calibration={odd / 'none.json'}")
    assert missing.returncode == 2 and "none.json" in missing.stderr  # read as the path, not a parse error


def test_slurms_time_limit_signal_reaching_a_rank_first_is_the_points_timeout(tmp_path, monkeypatch):
    """Under Slurm the time-limit warning (USR2) reaches every process of the job step, and a rank that
    inherited the job's handler can end on it before its supervisor sees it: CI, stop 39, such a
    point's row said ``crash`` ("SlurmSignal: ..." as the rank's own error). Here the rank alone is
    signalled: the row says ``timeout`` with Slurm's reason, as when the supervisor is."""
    import signal

    import harness.runner.worker as worker

    real = worker.train_step

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR2)  # in the forked rank: its supervisor is not signalled
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "train_step", signalled)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # run_job installs the Slurm handlers
    cfg = config(tmp_path, "++sweep.claim=t", "train.steps=2")
    before = signal.getsignal(signal.SIGUSR2)
    assert run_job(cfg) == "timeout"
    assert signal.getsignal(signal.SIGUSR2) == before  # the job's own handler is back
    frame, bad = load_results(tmp_path)
    assert bad == [] and frame["status"].tolist() == ["timeout"]
    error = frame["error"].iloc[0]
    assert error.startswith("Slurm sent SIGUSR2: the job's time limit"), error
    assert error.endswith("(it reached rank 0 first)"), error
