"""scripts/gpu_check.py without a GPU (issue 33, item 11): the plan it makes here, the device run's
scheduling (per-item limits, the deadline and its 90 s rule, every item in a try, the result file after
each item, the table) with an injected point runner, and its parent never calling into torch.cuda."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _results(path: Path) -> dict:
    with tarfile.open(path) as tar:
        return json.loads(tar.extractfile("results.json").read())


def test_plan_mode_composes_estimates_and_traces_every_point(tmp_path):
    gc = _gpu_check()
    from harness.cli.config import compose, run_spec
    from harness.spec import from_dict

    path = tmp_path / "plan.json"
    assert gc.main(["--plan", "--plan-file", str(path)]) == 0
    text = path.read_text()
    assert str(ROOT) not in text and str(tmp_path) not in text  # commit-able: no local paths
    plan = json.loads(text)
    points = {p["name"]: p for p in plan["points"]}
    assert list(points) == [p.name for p in gc.POINTS]
    for p in plan["points"]:
        assert from_dict(p["spec"]) == run_spec(compose(p["overrides"]))  # the device rebuilds it
        e = p["estimate"]
        assert e["allocated_bytes"] <= e["reserved_bytes"] <= e["device_bytes"]
        assert "not cheap" in p["cpu_counterpart"]["skipped"]  # 8B-shaped: hours on this CPU
    # The uncapped point fits the H200 by the estimate and by its fake trace; the capped one does not.
    assert points["8b_bf16"]["estimate"]["fits"] and points["8b_bf16"]["fake"]["status"] == "ok"
    oom = points["8b_oom_as_a100_40gb"]
    assert not oom["estimate"]["fits"] and oom["fake"]["status"] == "oom"
    assert points["8b_fsdp2_zero3"]["spec"]["parallel"]["zero_stage"] == 3
    assert points["8b_fsdp2_zero3"]["fake"]["peak_allocated_bytes"] > 0


def test_committed_plan_matches_the_points_of_today():
    """The plan the device run reads (committed) is for today's points and presets: otherwise run
    `scripts/gpu_check.py --plan` again."""
    gc = _gpu_check()
    from harness.cli.config import compose, run_spec
    from harness.spec import from_dict

    plan, points = gc.load_points(ROOT / gc.PLAN)
    assert plan["version"] == gc.PLAN_VERSION
    for item, p in zip(gc.POINTS, points, strict=True):
        assert p["overrides"] == list(item.overrides)
        assert from_dict(p["spec"]) == run_spec(compose(list(item.overrides)))


def test_time_budget_stays_within_six_minutes():
    gc = _gpu_check()
    expected, longest = gc.time_budget()
    assert expected < longest <= 6 * 60
    assert gc.DEADLINE_S - gc.MIN_START_S > 0


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_device_run_keeps_limits_deadline_and_writes_after_each_item(tmp_path, capsys):
    gc = _gpu_check()
    plan, points = gc.load_points(ROOT / gc.PLAN)
    clock, calls = _Clock(), []
    out = tmp_path / "out"
    # seconds each item takes; the FSDP point's runner raises after 120 s
    takes = {"probe": 30, "8b_bf16": 100, "8b_fsdp2_zero3": 120}

    def runner(item, limit_s, work):
        seen = [p["name"] for p in _results(out / gc.RESULT_FILE)["points"]] if calls else None
        calls.append((item.name, limit_s, seen))
        clock.now += takes[item.name]
        if item.name == "8b_fsdp2_zero3":
            raise RuntimeError("CUDA error: an illegal memory access")
        if item.name == "probe":
            return {"status": "ok", "device_name": "NVIDIA H200"}
        return {"status": "ok", "device_name": "NVIDIA H200", "peak_reserved_bytes": 50 * gc.GIB}

    results = gc.device_run(out, plan, points, runner, clock=clock)
    # limits: each item's own, capped by the time left minus the kill grace; the last item would
    # start with 330 - 30 - 100 - 120 = 80 s left (< 90): skipped, never started
    assert calls == [
        ("probe", 60, None),
        ("8b_bf16", 120, []),
        ("8b_fsdp2_zero3", 150, ["8b_bf16"]),  # the file already held the point before
    ]
    statuses = [(p["name"], p["status"]) for p in results["points"]]
    assert statuses == [("8b_bf16", "ok"), ("8b_fsdp2_zero3", "error"), ("8b_oom_as_a100_40gb", "skipped")]
    assert "illegal memory access" in results["points"][1]["error"]
    assert "80 s left" in results["points"][2]["error"]
    assert results["device_name"] == "NVIDIA H200"
    written = _results(out / gc.RESULT_FILE)
    assert [p["status"] for p in written["points"]] == ["ok", "error", "skipped"]
    assert written["probe"]["status"] == "ok"
    reserved = written["points"][0]["compare"]["reserved"]
    assert reserved["measured_bytes"] == 50 * gc.GIB
    assert reserved["estimate_bytes"] == points[0]["estimate"]["reserved_bytes"]
    table = gc.table(results)
    assert "8b_oom_as_a100_40gb" in table and "skipped (want oom)" in table
    assert "50.00/—/" in table  # measured reserved, no replay, then the estimate


def test_compare_puts_the_levels_side_by_side():
    gc = _gpu_check()
    point = {
        "estimate": {
            "allocated_bytes": 90,
            "reserved_bytes": 110,
            "calibrated_reserved_bytes": 126,
            "device_bytes": 150,
        },
        "fake": {},
    }
    record = {
        "peak_allocated_bytes": 100,
        "peak_reserved_bytes": 120,
        "device_used_bytes": 160,
        "replay": {"peak_reserved_bytes": 120},
    }
    c = gc.compare(point, record)
    assert c["allocated"]["estimate_error"] == pytest.approx(-0.10)  # (90 - 100) / 100
    assert c["reserved"]["replay_exact"] is True and c["reserved"]["replay_error"] == 0
    assert c["reserved"]["estimate_error"] == pytest.approx(-10 / 120)
    assert c["reserved"]["calibrated_error"] == pytest.approx(6 / 120)  # the default profile's level
    assert c["device"]["estimate_error"] == pytest.approx(-10 / 160)
    assert "fake_error" not in c["allocated"]  # no fake peak given


_FAKE_CHILD = r"""
import json, os, sys, time
argv = sys.argv[1:]
role, result = argv[0], argv[1]
name = argv[argv.index("--point") + 1] if "--point" in argv else "probe"
if name == "8b_fsdp2_zero3":
    time.sleep(60)  # hangs: killed at its limit
status = "oom" if "oom" in name else "ok"
nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
record = {"status": status, "device_name": "NVIDIA H200", "nvml_check": nvml,
          "peak_allocated_bytes": 1 << 30, "peak_reserved_bytes": 1 << 31, "device_used_bytes": 3 << 30}
print("rank log line of", name)
json.dump(record, open(result, "w"))
"""


def _fake_argv(role, result, **options):
    argv = [sys.executable, "-c", _FAKE_CHILD, role, str(result)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def test_parent_never_calls_cuda_and_children_run_under_their_limits(tmp_path, monkeypatch, capsys):
    gc = _gpu_check()

    def forbidden(*args, **kwargs):
        raise AssertionError("the gpu_check parent called into torch.cuda")

    for name in ("is_available", "device_count", "get_device_name", "_lazy_init", "init", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    # short limits: the hanging child is killed at 3 s, the deadline leaves every item its 90 s
    items = tuple(
        gc.Item(i.name, i.what, limit_s=3.0, expected_s=1, overrides=i.overrides, expected=i.expected)
        for i in gc.ITEMS
    )
    monkeypatch.setattr(gc, "ITEMS", items)
    monkeypatch.setattr(gc, "CHILD_OVERHEAD_S", 0.0)
    plan_path = ROOT / gc.PLAN
    runner = gc.ChildRunner(plan_path, argv=_fake_argv)
    plan, points = gc.load_points(plan_path)
    out = tmp_path / "out"
    results = gc.device_run(out, plan, points, runner, items=items)
    got = {p["name"]: p["status"] for p in results["points"]}
    assert got == {"8b_bf16": "ok", "8b_fsdp2_zero3": "timeout", "8b_oom_as_a100_40gb": "oom"}
    assert results["probe"]["record"]["nvml_check"] == "1"  # is_available() in the children: no context
    assert results["device_name"] == "NVIDIA H200"  # from a child, never asked here
    with tarfile.open(out / gc.RESULT_FILE) as tar:
        names = tar.getnames()
        log = tar.extractfile("logs/8b_bf16.log").read().decode()
    assert {"results.json", "logs/probe.log", "logs/8b_oom_as_a100_40gb.log"} <= set(names)
    assert "rank log line of 8b_bf16" in log
    assert sorted(p.name for p in out.iterdir()) == [gc.RESULT_FILE]  # one file, no temporary left


def test_result_file_leaves_out_traces_beyond_its_budget(tmp_path, monkeypatch):
    gc = _gpu_check()
    monkeypatch.setattr(gc, "TRACE_BYTES_KEPT", 150)
    work = tmp_path / "work"
    (work / "p" / "traces").mkdir(parents=True)
    (work / "p" / "traces" / "a.rank0.trace.json").write_text("x" * 100)
    (work / "p" / "traces" / "b.rank1.trace.json").write_text("x" * 100)
    (work / "p" / "rank0.log").write_text("log")
    path = gc.write_results(tmp_path / "out", {"points": []}, work)
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    assert {"p/traces/a.rank0.trace.json", "p/rank0.log", "results.json"} <= names
    assert "p/traces/b.rank1.trace.json" not in names
    assert _results(path)["traces_left_out"] == ["p/traces/b.rank1.trace.json"]
