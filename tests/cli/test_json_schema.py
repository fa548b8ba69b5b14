"""One JSON envelope (issue 31 item 6): every command's ``format=json`` carries ``schema_version``,
``units`` and ``notes`` (what it said on stderr), and estimate and plan name each level's share of
the card the same way."""

from __future__ import annotations

import json

from conftest import harness_cli

from harness.cli.render.common import SCHEMA_VERSION

LEVELS = ("allocated_utilisation", "reserved_utilisation", "device_utilisation")


def _json(*args):
    done = harness_cli(*args, "format=json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_every_command_closes_with_the_same_fields(tmp_path):
    outputs = [
        _json("estimate", "model=llama3_8b"),
        _json("plan", "model=llama3_8b", "device=h100_80gb", "plan.gpus=8"),
        _json(
            "plan", "model=llama3_8b", "plan.solve=max_micro_batch", "parallel.dp=8", "parallel.zero_stage=3"
        ),
        _json("run", "model=tiny", "run.mode=fake", f"results_dir={tmp_path}"),
    ]
    for record, stderr in outputs:
        assert record["schema_version"] == SCHEMA_VERSION and "*_bytes" in record["units"]
        said = [line for line in stderr.splitlines() if line.startswith(("note:", "harness: warning:"))]
        assert all(line in record["notes"] for line in said)
    assert any("GPU-scale" in n for n in outputs[0][0]["notes"])


def test_estimate_and_plan_name_the_levels_alike():
    est, _ = _json("estimate", "model=llama3_8b", "device=h100_80gb", "parallel.dp=8", "calibration=none")
    assert est["allocated_utilisation"] == est["total_bytes"] / est["capacity_bytes"]
    assert est["reserved_utilisation"] == est["reserved_total_bytes"] / est["capacity_bytes"]
    assert est["device_utilisation"] == est["device_total_bytes"] / est["capacity_bytes"]
    plan, _ = _json("plan", "model=llama3_8b", "device=h100_80gb", "plan.gpus=8", "calibration=none")
    row = plan["layouts"][0]
    assert row["allocated_utilisation"] <= row["reserved_utilisation"] <= row["device_utilisation"]
    assert row["device_utilisation"] == row["utilisation"]
