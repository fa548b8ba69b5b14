"""What a newcomer gets by default (issue 32 item 4): a GPU preset's estimate and plan apply the
committed paper-scale profile, say so in one line, and ``calibration=none`` turns it off; the CPU and
the other engines get none; a CPU-fitted profile on a GPU preset says it is applied outside its fit."""

from __future__ import annotations

import json

from conftest import harness_cli

from harness.cli.shared import DEFAULT_GPU_PROFILE

GPU = (
    "estimate",
    "model=llama3_8b",
    "device=h100_80gb",
    "parallel.dp=8",
    "parallel.zero_stage=3",
    "format=json",
)


def test_a_gpu_preset_gets_the_committed_profile_and_is_told():
    done = harness_cli(*GPU)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["calibration"] == DEFAULT_GPU_PROFILE
    # The verdict is the calibrated device level, above the uncalibrated one (the fitted fragmentation).
    assert record["calibrated_device_total_bytes"] > record["device_total_bytes"]
    assert record["fits"] == (record["calibrated_device_total_bytes"] <= 0.8 * record["capacity_bytes"])
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: calibration=")]
    assert len(notes) == 1 and "calibration=none turns it off" in notes[0]


def test_calibration_none_turns_it_off():
    done = harness_cli(*GPU, "calibration=none")
    assert done.returncode == 0, done.stderr
    assert "calibration" not in json.loads(done.stdout)
    assert "note: calibration=" not in done.stderr


def test_no_default_profile_on_the_cpu_or_for_another_engine():
    cpu = harness_cli("estimate", "model=tiny", "format=json")
    assert "calibration" not in json.loads(cpu.stdout) and "note: calibration=" not in cpu.stderr
    megatron = harness_cli(*GPU, "engine=megatron")
    assert megatron.returncode == 0, megatron.stderr
    assert "calibration" not in json.loads(megatron.stdout)


def test_a_model_outside_the_profiles_fit_is_named():
    done = harness_cli(
        "estimate", "model.hf_config=docs/examples/Llama-3.2-1B/config.json", "device=a100_40gb"
    )
    assert done.returncode == 0, done.stderr
    assert "applied outside that: 1.24 B parameters" in done.stderr


def test_a_cpu_fitted_profile_on_a_gpu_preset_says_so():
    done = harness_cli(*GPU, "calibration=results/cpu_study_v2/calibration.json")
    assert done.returncode == 0, done.stderr
    assert "applied outside what it was fitted on: device h100_80gb (fitted on cpu)" in done.stderr
