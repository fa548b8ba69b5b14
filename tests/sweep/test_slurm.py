"""Sweeps through a real Slurm (scripts/slurm_local.sh start: two nodes on localhost): every point a row,
including ones that Slurm kills at their time limit, which the next run of the sweep runs again, and
points wider than a node. Marked ``slurm``; skipped when no Slurm answers.

submitit reads job states from ``sacct``. The script runs Slurm's own accounting (slurmdbd on MariaDB);
only if that cannot start does a squeue-backed stand-in answer, and ``accounting()`` names which one
(each test's first assertion message carries it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import harness_cli

from harness.sweep.store import load_results

pytestmark = pytest.mark.slurm


def slurm_is_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20, check=False)
    return r.returncode == 0 and any(state in r.stdout for state in ("idle", "mix", "alloc"))


def accounting() -> str:
    """``slurmdbd`` when Slurm's accounting answers, else ``squeue stand-in`` (scripts/slurm_local.sh)."""
    r = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, timeout=20, check=False
    )
    return "slurmdbd" if "accounting_storage/slurmdbd" in r.stdout else "squeue stand-in"


def sacct_states(job_ids) -> dict[str, str]:
    """Slurm's own record of each job's end (``sacct``: COMPLETED, TIMEOUT, ...), once every job has
    ended (a job reads RUNNING for a moment after its result is written, while Python exits)."""
    import time

    for _ in range(60):
        r = subprocess.run(
            ["sacct", "--parsable2", "-o", "JobIDRaw,State", "-j", ",".join(job_ids)],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        rows = [line.split("|") for line in r.stdout.splitlines()[1:] if "|" in line]
        states = {job: state.split()[0] for job, state in rows if "." not in job}
        if not {"RUNNING", "COMPLETING", "PENDING"} & set(states.values()):
            break
        time.sleep(0.5)
    return states


@pytest.fixture(autouse=True)
def needs_slurm():
    if not slurm_is_up():
        pytest.skip("no Slurm cluster answers (bash scripts/slurm_local.sh start)")


def sweep(results_dir, *overrides) -> subprocess.CompletedProcess:
    return harness_cli(
        "sweep",
        "+study=cpu_smoke",
        f"results_dir={results_dir}",
        "sweep.name=slurm",
        "hydra/launcher=submitit_slurm",
        "parallel.tp=1",
        "parallel.zero_stage=0",
        *overrides,
        timeout=900,
    )


def test_points_run_as_slurm_jobs_and_a_time_limit_kill_is_a_row(tmp_path):
    # Two normal points and two that cannot finish inside Slurm's 1-minute limit (their own timeout is
    # longer, so only Slurm can end them: submitit asks for USR2 5 s before the limit). One rank per
    # node: the dp=2 points are two-node jobs, so a time-limit kill of a multi-node point is covered too.
    r = sweep(
        tmp_path,
        "parallel.dp=1,2",
        "train.steps=2,100000",
        "run.timeout_s=600",
        "sweep.ranks_per_node=1",
        "hydra.launcher.timeout_min=1",
        "hydra.launcher.signal_delay_s=5",
    )
    assert r.returncode == 0, f"accounting: {accounting()}\n" + r.stderr[-3000:]
    frame, bad = load_results(tmp_path)
    assert bad == [] and len(frame) == 4
    assert frame["env_slurm_job_id"].notna().all()  # they ran as Slurm jobs
    short, long = frame[frame["train_steps"] == 2], frame[frame["train_steps"] == 100000]
    assert set(short["status"]) == {"ok"}
    assert sorted(short["launch_tasks"]) == [1, 2]
    assert sorted(long["env_slurm_nodelist"]) == ["harness-n1", "harness-n[1-2]"]
    assert set(long["status"]) == {"timeout"}, long[["status", "error"]].to_dict("records")
    assert long["error"].str.contains("Slurm sent SIGUSR2").all()
    # Slurm's own record: every job, the signalled ones included, ended by itself (COMPLETED) after
    # writing its row, before Slurm's kill at the limit (which would read TIMEOUT).
    states = sacct_states(list(frame["env_slurm_job_id"]))
    assert [states.get(j) for j in frame["env_slurm_job_id"]] == ["COMPLETED"] * 4, states
    # Resume: every point has its row, nothing runs again.
    again = sweep(tmp_path, "parallel.dp=1,2", "train.steps=2,100000", "run.timeout_s=600")
    assert "4 points: 4 already done" in again.stdout


def test_a_point_wider_than_a_node_runs_on_two_nodes(tmp_path):
    # With two ranks per node, the 4-rank point is a two-node Slurm job (the local cluster's two
    # slurmd, harness-n1 and -n2): one task per node forks its two ranks, they meet at the first node,
    # and task 0 writes the row. The 2-rank point stays on one node.
    from conftest import spec

    from harness.runner.supervisor import run_point

    r = sweep(tmp_path, "parallel.dp=2,4", "train.steps=2", "sweep.ranks_per_node=2")
    assert r.returncode == 0, r.stderr[-3000:]
    frame, bad = load_results(tmp_path)
    assert bad == [] and len(frame) == 2 and set(frame["status"]) == {"ok"}, frame[["status", "error"]]
    wide = frame[frame["parallel_dp"] == 4].iloc[0]
    narrow = frame[frame["parallel_dp"] == 2].iloc[0]
    assert wide["launch_tasks"] == 2 and list(wide["launch_hosts"]) == ["harness-n1", "harness-n2"]
    assert wide["env_slurm_nodelist"] == "harness-n[1-2]"
    assert narrow["launch_tasks"] == 1 and "," not in narrow["env_slurm_nodelist"]
    # The same point forked on this machine alone: the same losses (fp32, same ranks, same data).
    same = {k: wide[k].item() for k in ("train_steps", "train_seq_len", "train_micro_batch_size")}
    local = run_point(spec("tiny", parallel_dp=4, train_precision="fp32", **same), timeout_s=120)
    assert local["status"] == "ok"
    assert list(wide["losses"]) == pytest.approx(local["losses"], rel=1e-6)
    assert not (tmp_path / ".points").exists() or not any((tmp_path / ".points").iterdir())


def test_one_task_per_rank_on_one_node(tmp_path):
    # submitit's usual shape (tasks_per_node = ranks): each task forks its one rank.
    r = sweep(tmp_path, "parallel.dp=2", "train.steps=2", "hydra.launcher.tasks_per_node=2")
    assert r.returncode == 0, r.stderr[-3000:]
    frame, bad = load_results(tmp_path)
    assert bad == [] and len(frame) == 1
    row = frame.iloc[0]
    assert row["status"] == "ok", row["error"]
    assert row["launch_tasks"] == 2 and row["env_slurm_nodelist"] in ("harness-n1", "harness-n2")
    assert list(row["launch_hosts"]) == [row["env_slurm_nodelist"]] * 2


def harness_run(launcher: list[str], tmp_path, *point: str) -> subprocess.CompletedProcess:
    """`harness run <point> format=json` started by a Slurm command (srun, sbatch)."""
    import sys

    return subprocess.run(
        [*launcher, sys.executable, "-m", "harness", "run", *point, "format=json", f"results_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_harness_run_under_srun_on_two_nodes(tmp_path):
    # One point outside a sweep: `srun --nodes=2 harness run ...` prints one record, from task 0.
    import json

    point = ["parallel.dp=2", "parallel.tp=2", "train.precision=fp32", "train.seq_len=64"]
    r = harness_run(["srun", "--nodes=2", "--ntasks-per-node=1"], tmp_path, *point)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(r.stdout)  # one JSON document: the other task printed nothing
    assert record["status"] == "ok" and record["launch_tasks"] == 2
    assert record["launch_hosts"] == ["harness-n1", "harness-n2"]


def test_harness_run_in_a_batch_script_of_two_nodes_is_one_task(tmp_path):
    # Not under srun (the batch step of a two-node allocation): one task forks every rank here.
    import json

    script = tmp_path / "job.sh"
    script.write_text('#!/bin/sh\nexec "$@"\n')
    out = tmp_path / "job.out"
    sbatch = ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", f"--output={out}", str(script)]
    r = harness_run(sbatch, tmp_path, "parallel.dp=2", "train.precision=fp32", "train.seq_len=64")
    assert r.returncode == 0, r.stderr[-3000:] + out.read_text()[-3000:]
    record = json.loads(out.read_text())
    assert record["status"] == "ok" and record["launch_tasks"] == 1
    assert record["env_slurm_nodelist"] == "harness-n[1-2]"
