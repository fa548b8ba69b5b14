"""Every file under sweeps/ composes, and the presets agree with the specs and the peak table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.cli.config import compose, config_dir, engine_name, run_spec
from harness.estimate import ENGINES, peak_tflops_for
from harness.spec import canonical

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"
PRESETS = sorted((path.parent.name, path.stem) for path in SWEEPS.glob("*/*.yaml"))


def test_the_cli_reads_this_tree():
    assert config_dir() == SWEEPS.resolve()


def test_there_are_presets_for_every_group():
    groups = {g for g, _ in PRESETS}
    assert {"model", "parallel", "train", "device", "engine", "study"} <= groups


@pytest.mark.parametrize(("group", "name"), PRESETS, ids=[f"{g}/{n}" for g, n in PRESETS])
def test_every_file_composes_into_a_valid_spec(group, name):
    # Studies are not in the defaults list: they are appended (+study=…).
    cfg = compose([f"+{group}={name}" if group == "study" else f"{group}={name}"])
    spec = canonical(run_spec(cfg))  # raises with the reasons if a preset is impossible
    assert engine_name(cfg) in ENGINES
    if group == "model":
        assert spec.model.name == name
    if group == "device":
        assert spec.device.name == name


@pytest.mark.parametrize("name", [n for g, n in PRESETS if g == "device"])
def test_device_peaks_match_the_flops_table(name):
    spec = run_spec(compose([f"device={name}"]))
    table = peak_tflops_for(name)
    if spec.device.peak_tflops is None:
        assert math.isnan(table)
    else:
        assert spec.device.peak_tflops == table


def test_required_presets_exist():
    names = {n for _, n in PRESETS}
    for required in (
        "llama2_7b",
        "llama2_13b",
        "llama2_70b",
        "llama3_8b",
        "llama3_70b",
        "llama31_405b",
        "tiny",
        "small",
        "cpu",
        "a100_40gb",
        "a100_80gb",
        "h100_80gb",
        "h100_94gb",
        "h200_141gb",
        "paper",
        "megatron",
        "torch",
    ):
        assert required in names
