"""The commands as a user runs them: readable output, JSON fields, one-line errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import harness_cli

from harness.cli.main import main

EXAMPLE = [
    "model=llama3_8b",
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.dp=2",
    "train.seq_len=8192",
    "train.micro_batch_size=1",
    "engine=paper",
    "device=h100_94gb",
]


def run(*args: str) -> subprocess.CompletedProcess:
    return harness_cli(*args, timeout=120)


def test_estimate_table_as_in_the_issue():
    r = run("estimate", *EXAMPLE)
    assert r.returncode == 0, r.stderr
    assert "most-loaded rank: stage 0, 45.21 GiB of 93.58 GiB = 48.3% allocated" in r.stdout
    # The verdict is the device level's: the tensors, the allocator's segments, the CUDA context and
    # NCCL's buffers (levels.py; the h100_94gb preset's constants).
    assert "device level (what runs out):" in r.stdout and "→ fits (threshold 80%)" in r.stdout
    for term in ("params", "grads", "optimizer", "activations", "logits"):
        assert f"\n{term} " in r.stdout


def test_estimate_json_has_integer_byte_fields(capsys):
    assert main(["estimate", *EXAMPLE[:-2], "engine=torch", "device=h100_94gb", "format=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"):
        assert isinstance(out[key], int) and out[key] > 0
    # the worst stage's (stage 0: its gradients are made after its peak); the last stage holds some
    assert isinstance(out["grads_bytes"], int) and out["grads_bytes"] >= 0
    assert len(out["stages"]) == 2 and out["stages"][1]["grads_bytes"] > 0
    assert out["total_bytes"] == max(s["total_bytes"] for s in out["stages"])
    assert out["fits"] is (out["utilisation"] <= 0.8)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["parallel.tpp=2"], "unknown key 'parallel.tpp' (did you mean parallel.tp?)"),
        (["model=llama9"], "unknown model preset 'llama9'"),
        (["parallel.tp=3"], "num_heads 4 % tp 3 = 1 ≠ 0"),
        (["train.seq_len=-1"], "train.seq_len=-1 must be >= 1"),
        (["parallel.tp=two"], "parallel.tp='two' must be int"),
        (["format=xml"], "format='xml' must be table or json"),
        (["threshold=-1"], "threshold=-1 must be a ratio of the device's memory in (0, 1] (0.8 = 80 %)"),
        (["parallel.tp"], "override 'parallel.tp' is not key=value"),
        (["parallel.tp=[1"], "no viable alternative at input '[1'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, expected):
    r = run("estimate", *args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("harness estimate: error: ")
    assert expected in r.stderr


def test_unknown_command_and_help(capsys):
    assert main(["estimat"]) == 2
    assert "unknown command 'estimat'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "estimate" in capsys.readouterr().out


def test_sigterm_mid_point_is_one_line_and_exit_143(monkeypatch, capsys):
    """A run or sweep terminated mid-point (the supervisor raises ``Terminated`` once the ranks are
    reaped): one line saying no row was written, exit 128 + 15, no traceback."""
    from harness.cli import main as cli
    from harness.runner.procs import Terminated

    def terminated(overrides):
        raise Terminated("SIGTERM reached rank 1: the point has no outcome")

    monkeypatch.setitem(cli.COMMANDS, "sweep", terminated)
    assert main(["sweep", "+study=cpu_smoke"]) == 143
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "harness sweep: terminated (SIGTERM reached rank 1: the point has no outcome); no row was "
        "written for the point in progress: run the sweep again to resume"
    ]


def test_plan_lists_fitting_layouts(capsys):
    assert (
        main(
            [
                "plan",
                "model=llama3_70b",
                "device=h100_80gb",
                "train.seq_len=8192",
                "plan.gpus=32",
                "format=json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["considered"] == out["invalid"] + out["valid"]
    assert out["fitting"] == len(out["layouts"]) > 0
    for row in out["layouts"]:
        assert row["utilisation"] <= 0.8
        assert row["parallel_dp"] * row["parallel_tp"] * row["parallel_pp"] * row["parallel_cp"] == 32
    times = [row["step_time_proxy_s"] for row in out["layouts"]]
    assert times == sorted(times)


def test_plan_table_says_when_nothing_fits(capsys):
    assert main(["plan", "model=llama31_405b", "device=a100_40gb", "plan.gpus=8"]) == 0
    assert "nothing fits; the smallest needs" in capsys.readouterr().out


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("harness") or str(__import__("pathlib").Path(sys.executable).parent / "harness")
    r = subprocess.run(
        [exe, "estimate", "format=json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "tiny"


def test_tables_print_the_recomputation_method_and_its_n():
    """Every-N and Megatron's methods printed as they are (they all printed as ``full``)."""
    from harness.cli.render.common import recompute_label

    assert recompute_label("full") == "full" and recompute_label("selective", 2, "uniform") == "selective"
    assert recompute_label("full", 2, "every") == "full/2"
    assert recompute_label("full", 2, "uniform") == "full/uniform2"
    assert recompute_label("full", 4, "block") == "full/block4"
    assert recompute_label("full", None, None) == "full"  # a row from before the fields existed
    res = harness_cli(
        "estimate",
        "model=tiny",
        "train.recompute=full",
        "train.recompute_every=2",
        "train.recompute_method=uniform",
    )
    assert res.returncode == 0, res.stderr
    assert "recompute full/uniform2" in res.stdout


def test_threshold_is_a_ratio_and_names_the_percentage_meant():
    # issue 31: threshold=80 printed "210.6% utilisation → fits (threshold 8000%)"
    r = harness_cli("estimate", "model=llama3_8b", "threshold=80")
    assert r.returncode == 2 and r.stdout == ""
    assert (
        "threshold=80 must be a ratio of the device's memory in (0, 1] (0.8 = 80 %); did you mean 0.8?"
        in r.stderr
    )
    assert harness_cli("estimate", "model=llama3_8b", "threshold=0").returncode == 2


def test_the_verdict_never_says_fits_over_the_card():
    from harness.cli.render.common import verdict

    gib = 2**30
    assert verdict(60 * gib, 80 * gib, 0.8) == "fits"  # 75 %
    assert verdict(70 * gib, 80 * gib, 0.8) == "over the safety margin (10.00 GiB of headroom left)"
    assert verdict(90 * gib, 80 * gib, 0.8) == "does NOT fit (10.00 GiB over the card)"
    assert verdict(90 * gib, 80 * gib, 1.0).startswith("does NOT fit")  # whatever the threshold
    # Issue 32: over the card at the reserved level while the tensors fit: the allocator decides.
    assert verdict(90 * gib, 80 * gib, 0.8, allocated_bytes=75 * gib) == (
        "does NOT fit at the reserved level (10.00 GiB over the card; the tensors fit: only after cache "
        "flushes, or out of memory by fragmentation)"
    )
    assert (
        verdict(90 * gib, 80 * gib, 0.8, allocated_bytes=85 * gib) == "does NOT fit (10.00 GiB over the card)"
    )


STUDY_PROFILE = Path(__file__).resolve().parents[2] / "results" / "cpu_study_v2" / "calibration.json"


def test_a_profile_threshold_applies_only_to_its_device_kind():
    # The CPU study's profile learned its threshold on cpu: not a margin for an H100.
    r = harness_cli(
        "plan",
        "model=llama3_8b",
        "device=h100_80gb",
        "parallel.dp=8",
        "parallel.zero_stage=3",
        "plan.solve=max_seq_len",
        "threshold=profile",
        f"calibration={STUDY_PROFILE}",
    )
    assert r.returncode == 2
    assert "learned its threshold on cpu, not on h100_80gb" in r.stderr


@pytest.mark.parametrize("fmt", ["table", "json"])
@pytest.mark.parametrize(
    ("solve", "extra", "said"),
    [
        ("min_gpus", ["plan.max_gpus=8"], "no layout fits on any of 1, 2, 4, 8 devices"),
        ("max_micro_batch", ["parallel.dp=1"], "not even micro-batch 1 fits"),
        ("max_seq_len", ["parallel.dp=1"], "not even 128 tokens fit"),
    ],
)
def test_every_reverse_question_without_an_answer_says_so(solve, extra, said, fmt, capsys):
    # issue 31: min_gpus with no answer within plan.max_gpus ended in a traceback
    code = main(["plan", "model=llama31_405b", f"plan.solve={solve}", f"format={fmt}", *extra])
    out = capsys.readouterr().out
    assert code == 0
    if fmt == "json":
        got = json.loads(out)
        assert got["answer"] is None and got["best"] is None
    else:
        assert said in out and ": none; " in out


def test_a_real_run_beyond_reach_is_refused_up_front_with_the_way_to_see_it(tmp_path):
    # issue 31: `run` of a paper-scale model on the CPU launched its ranks and waited out the timeout
    r = harness_cli("run", "model=llama3_8b", "device=cpu", f"results_dir={tmp_path}")
    assert r.returncode == 2 and r.stdout == ""
    assert "not run: estimate" in r.stderr and "run.mode=fake traces it" in r.stderr
    assert list(tmp_path.iterdir()) == []
