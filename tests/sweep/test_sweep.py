"""Sweeps end to end: every point ends as exactly one row; an interrupted sweep resumes without
running anything twice; an impossible layout is a row and the sweep goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import harness_cli

from harness.sweep.store import load_results, result_files

SMALL = ["+study=cpu_smoke", "train.seq_len=32", "parallel.zero_stage=0"]


def sweep(results_dir, *overrides) -> subprocess.CompletedProcess:
    return harness_cli("sweep", *SMALL, f"results_dir={results_dir}", "sweep.name=t", *overrides)


def test_invalid_point_is_a_row_and_the_sweep_goes_on(tmp_path):
    r = sweep(tmp_path, "parallel.dp=1", "parallel.tp=1,3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 points: 1 to launch, 1 invalid (row written)" in r.stdout
    assert "[1/1] ok" in r.stdout
    frame, bad = load_results(tmp_path)
    assert bad == [] and sorted(frame["status"]) == ["invalid", "ok"]
    invalid = frame[frame["status"] == "invalid"].iloc[0]
    assert "num_heads 4 % tp 3" in invalid["error"] and invalid["sweep_name"] == "t"
    # Resume: nothing left to do, nothing runs twice.
    again = sweep(tmp_path, "parallel.dp=1", "parallel.tp=1,3")
    assert "2 points: 2 already done" in again.stdout
    assert len(result_files(tmp_path)) == 2


def test_interrupted_sweep_resumes_with_every_point_exactly_once(tmp_path):
    overrides = ["parallel.dp=1,2", "parallel.tp=1,2"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness",
            "sweep",
            *SMALL,
            f"results_dir={tmp_path}",
            "sweep.name=t",
            *overrides,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while len(result_files(tmp_path)) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the ranks of the point it was running
    proc.wait()
    first = {p.stem: p.stat().st_mtime_ns for p in result_files(tmp_path)}
    assert 1 <= len(first) < 4
    status = harness_cli("results", "status", f"results_dir={tmp_path}")
    assert f"sweep t: 4 points, {len(first)} with a row, {4 - len(first)} left" in status.stdout
    r = sweep(tmp_path, *overrides)
    assert r.returncode == 0, r.stderr[-2000:]
    frame, bad = load_results(tmp_path)
    assert bad == [] and len(frame) == 4 and frame["config_id"].is_unique
    assert set(frame["status"]) == {"ok"}
    # The points finished before the interruption were not run again.
    assert {p.stem: p.stat().st_mtime_ns for p in result_files(tmp_path) if p.stem in first} == first


def test_grids_sweep_the_union_and_a_shared_point_runs_once(tmp_path):
    """hydra.sweeper.grids (how cpu_study lists its sub-grids): tp=2 is in both grids, tp=3 impossible."""
    r = harness_cli(
        "sweep",
        "+study=cpu_smoke",
        "train.seq_len=32",
        "parallel.zero_stage=0",
        f"results_dir={tmp_path}",
        "sweep.name=t",
        "hydra.sweeper.params={parallel.dp:1}",
        'hydra.sweeper.grids=[{parallel.tp:"1,2"},{parallel.tp:"2,3"}]',
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 points: 2 to launch, 1 duplicates, 1 invalid (row written)" in r.stdout
    frame, _ = load_results(tmp_path)
    assert sorted(zip(frame["parallel_tp"], frame["status"], strict=True)) == [
        (1, "ok"),
        (2, "ok"),
        (3, "invalid"),
    ]


def test_dry_run_counts_and_writes_nothing(tmp_path):
    r = sweep(tmp_path, "parallel.dp=1", "parallel.tp=1,3", "sweep.dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 points: 1 to launch, 1 invalid (row not written: dry run)" in r.stdout
    assert "[1/1]" not in r.stdout and result_files(tmp_path) == []


def test_dry_run_says_how_many_nodes_each_job_asks_for(tmp_path):
    # world 1, 2 and 4 with two ranks per node: one job of one node each for 1 and 2, two nodes for 4
    # (tests/sweep/test_slurm.py runs such a two-node job on a real Slurm).
    r = sweep(tmp_path, "parallel.dp=1,2,4", "parallel.tp=1", "sweep.ranks_per_node=2", "sweep.dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "harness sweep: jobs by size: 2 on 1 node, 1 on 2 nodes" in r.stdout
    bad = sweep(tmp_path, "parallel.dp=1", "parallel.tp=1", "sweep.ranks_per_node=0", "sweep.dry_run=true")
    assert bad.returncode != 0 and "sweep.ranks_per_node=0: must be >= 1" in bad.stderr + bad.stdout
