"""Bad values and unbounded sizes are one line and exit 2, never a traceback, a hang or a fork bomb
(issue 29, items 7 and 8). Each case failed on the code before: a traceback (OverflowError,
ZeroDivisionError, MemoryError, TypeError, RecursionError), a silent truncation (plan.gpus=1.5 as 1,
replay.capacity_bytes=1.5 as 1 byte), a read that never ends (/dev/zero, a FIFO) or minutes of work."""

from __future__ import annotations

import json
import os
import time

import pytest

from harness.cli.main import main


def one_line_error(capsys, args: list[str]) -> str:
    start = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("note: ")]  # a GPU-scale model's note
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", "device.memory_gib=inf"], "device.memory_gib=inf must be a finite number of GiB > 0"),
        (["estimate", "device.memory_gib=1e-30"], "device.memory_gib=1e-30 is under 1 MiB"),
        (["estimate", "parallel.pp=1000000", "model.num_layers=1000000"], "pipeline chunks is over 4,096"),
        (["estimate", "parallel.dp=100000000000"], "parallel.dp=100000000000 is over 1,048,576 ranks"),
        (["estimate", "model.head_dim=99999999999"], "model.head_dim=99,999,999,999 is over 2,147,483,647"),
        (["plan", "plan.gpus=1.5"], "plan.gpus=1.5 must be a whole number"),
        (["plan", "plan.gpus=1000000000000"], "plan.gpus=1000000000000 must be from 1 to 1,048,576"),
        (
            ["plan", "model=llama3_8b", "plan.solve=min_gpus", "plan.max_gpus=1000000000000"],
            "plan.max_gpus=1000000000000 must be from 1 to 1,048,576",
        ),
        (["plan", "plan.top=0"], "plan.top=0 must be from 1"),
    ],
)
def test_bad_sizes_are_one_line(capsys, args, message):
    assert message in one_line_error(capsys, args)


def test_run_refuses_more_ranks_than_a_host_should_fork(capsys):
    err = one_line_error(capsys, ["run", "parallel.dp=100000"])
    assert "not run" in err
    err = one_line_error(capsys, ["run", "parallel.dp=64", "model=tiny"])
    assert "64 ranks on one host, over its limit" in err


@pytest.mark.parametrize(
    ("events", "extra", "message"),
    [
        ([{"action": "alloc", "addr": 1, "size": 10, "stream": [1]}], [], "stream [1] is not an integer"),
        ([], ["replay.capacity_bytes=1.5"], "replay.capacity_bytes=1.5 must be a whole number of bytes"),
        ([], ["replay.max_split_size_mb=inf"], "replay.max_split_size_mb=inf must be a finite number"),
        (None, [], "JSON nested too deeply"),
    ],
)
def test_bad_traces_and_replay_settings_are_one_line(capsys, tmp_path, events, extra, message):
    path = tmp_path / "t.json"
    path.write_text("[" * 100_000 + "]" * 100_000 if events is None else json.dumps(events))
    assert message in one_line_error(capsys, ["replay", f"trace={path}", *extra])


CONFIG = os.path.join(
    os.path.dirname(__file__), "..", "..", "docs", "examples", "Llama-3.2-1B", "config.json"
)


def test_hf_configs_that_are_not_files_or_not_configs_are_one_line(capsys, tmp_path):
    assert "not a regular file" in one_line_error(capsys, ["estimate", "model.hf_config=/dev/zero"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in one_line_error(capsys, ["estimate", f"model.hf_config={fifo}"])
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in one_line_error(capsys, ["estimate", f"model.hf_config={deep}"])
    with open(CONFIG) as f:
        cfg = json.load(f)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({**cfg, "layer_types": 5}))
    assert "cannot model layer_types" in one_line_error(capsys, ["estimate", f"model.hf_config={odd}"])


@pytest.mark.parametrize("folder", ["2024", "true"])
def test_a_model_folder_named_like_a_number_or_a_bool_stays_a_name(capsys, tmp_path, folder):
    (tmp_path / folder).mkdir()
    with open(CONFIG) as f:
        (tmp_path / folder / "config.json").write_text(f.read())
    assert main(["estimate", f"model.hf_config={tmp_path / folder / 'config.json'}", "format=json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == folder


def test_min_gpus_bisects_whole_nodes(monkeypatch):
    # Issue 31: every node count was tried one by one (72 plans for Llama-3.1-405B). A layout fits from
    # 100 devices on (nodes of 4): found in O(log) tries up to a million devices, and the answer exact.
    import dataclasses

    from conftest import spec

    from harness.estimate import solve
    from harness.estimate.plan import PlanOptions
    from harness.spec import canonical

    class Result:
        def __init__(self, n):
            self.fitting = ["row"] if n >= 100 else []

    monkeypatch.setattr(solve, "plan", lambda base, opts: Result(opts.gpus))
    base = canonical(spec("tiny", "h100_94gb"))
    base = dataclasses.replace(base, device=dataclasses.replace(base.device, gpus_per_node=4))
    found = solve.min_gpus(base, PlanOptions(gpus=1), max_gpus=2**20)
    assert found.answer == 100 and len(found.tried) <= 15
    assert solve.min_gpus(base, PlanOptions(gpus=1), max_gpus=96).answer is None


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    # Issue 29: Ctrl-C printed 63 lines. A run interrupted mid-point: its ranks are reaped (the
    # supervisor's finally), one line, exit 130, no row.
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", "model=small", "train.steps=200", f"results_dir={tmp_path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default action, whatever this test inherited: a shell runs a background job (`cmd &`)
        # with SIGINT ignored, and Python then keeps ignoring it (the run finished, exit 0).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(8)  # past the imports, into the point
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        "harness run: interrupted (Ctrl-C); nothing was written for the work in progress"
    ]
    assert not list(tmp_path.glob("*.parquet"))


STUDY = os.path.join(os.path.dirname(__file__), "..", "..", "results", "cpu_study")


def test_where_calibrate_and_report_write_is_checked_before_the_work(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    err = one_line_error(capsys, ["calibrate", f"results_dir={STUDY}", f"calibrate.profile={tmp_path}"])
    assert f"calibrate.profile={tmp_path} is a directory; name a file" in err
    err = one_line_error(capsys, ["calibrate", f"results_dir={STUDY}", f"calibrate.profile={afile}/p.json"])
    assert f"is under {afile}, which is a file" in err
    err = one_line_error(capsys, ["report", f"results_dir={STUDY}", f"report.out={afile}"])
    assert f"report.out={afile} is a file; name a directory" in err


def test_a_disk_that_fails_under_a_command_is_one_line(capsys, monkeypatch, tmp_path):
    # A full or read-only results_dir (ENOSPC, EROFS) under report: the file and the reason, exit 2.
    import errno

    import harness.analysis.report as report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "report.md"))

    monkeypatch.setattr(report, "write_report", full)
    err = one_line_error(capsys, ["report", f"results_dir={STUDY}", f"report.out={tmp_path}"])
    assert (
        err
        == f"harness report: error: cannot write or read {tmp_path / 'report.md'}: No space left on device"
    )


def test_calibrate_and_report_name_bad_rows_and_use_the_rest(tmp_path):
    # One row with a null parallel_dp and one with an infinite peak ended calibrate and report in a
    # traceback (issue 29); they are named on stderr and the other 458 runs are used.
    import numpy as np
    import pandas as pd
    from conftest import harness_cli

    frame = pd.read_parquet(os.path.join(STUDY, "dataset.parquet"))
    ok = frame.index[frame["status"] == "ok"]
    frame["parallel_dp"] = frame["parallel_dp"].astype("float")
    frame.loc[ok[0], "parallel_dp"] = np.nan
    frame.loc[ok[1], "peak_allocated_bytes"] = np.inf
    frame.to_parquet(tmp_path / "dataset.parquet")
    r = harness_cli("calibrate", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    named = [ln for ln in r.stderr.splitlines() if ln.startswith("unusable: ")]
    assert len(named) == 2 and "not in canonical form" in named[0] and "peak_allocated_bytes=inf" in named[1]
    assert r.stdout.startswith("458 runs (ok or oom)")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("constant_s", -1e30, "step_time.constant_s=-1e+30 must be a finite number of seconds >= 0"),
        ("constant_s", "fast", "step_time.constant_s='fast' must be a finite number"),
        ("device", None, "step_time.device=None must be a device preset's name"),
        ("cpu_cores", 0, "step_time.cpu_cores=0 must be a whole number >= 1"),
        ("precisions", "bf16", "step_time.precisions='bf16' must be a list of names"),
        ("coefficients", [1], "step_time.coefficients must be an object"),
    ],
)
def test_a_profile_step_time_section_is_validated(capsys, tmp_path, field, value, message):
    with open(os.path.join(STUDY, "..", "cpu_study_v2", "calibration.json")) as f:
        profile = json.load(f)
    assert "step_time" in profile
    profile["step_time"][field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    err = one_line_error(capsys, ["plan", f"calibration={path}", "plan.gpus=2", "train.precision=fp32"])
    assert message in err


def test_a_swept_value_of_the_wrong_type_is_a_usage_error(capsys, tmp_path):
    # Issue 29: parallel.tp=1,abc wrote an invalid row for "abc" and exited 0.
    err = one_line_error(
        capsys, ["sweep", "parallel.tp=1,abc", f"results_dir={tmp_path}", "sweep.dry_run=true"]
    )
    assert err == "harness sweep: error: parallel.tp='abc' must be int"
    assert not list(tmp_path.glob("*.parquet"))


def test_plan_emit_refuses_the_name_of_a_built_in_study(capsys, tmp_path):
    # Issue 29: Hydra would find the built-in study of that name and run it instead of the emitted one.
    err = one_line_error(capsys, ["plan", f"plan.emit={tmp_path}/study/cpu_smoke.yaml"])
    assert "a built-in study is named cpu_smoke; name yours otherwise" in err


def test_estimate_json_carries_the_resolved_configuration(capsys):
    # Issue 28: the resolved train and parallel fields, as run records them (one configuration).
    assert main(["estimate", "model=llama3_8b", "parallel.dp=8", "parallel.zero_stage=3", "format=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train"]["num_microbatches"] == 1 and out["train"]["recompute"] == "op"
    assert out["parallel"]["fsdp_reshard_after_forward"] == "default" and out["stack"]["name"] == "torchtitan"


def test_sigterm_outside_a_point_is_one_line_and_exit_143(monkeypatch, capsys):
    # Issue 29: SIGTERM during a sweep's launch or closing summary (no point running, so no
    # supervisor's handler) killed the command silently, exit -15. Every command turns it into one line.
    import signal

    import harness.estimate

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM should have ended the command")

    monkeypatch.setattr(harness.estimate, "estimate", terminated)
    assert main(["estimate", "model=tiny"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness estimate: terminated (SIGTERM)")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the command's handler is undone
