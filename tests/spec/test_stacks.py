"""Named stacks (issue 28): the trainer's choices fill what the config leaves null, every command says
which, and the same overrides are one configuration in estimate, plan, run and sweep."""

from __future__ import annotations

import json

import pytest
from conftest import harness_cli

from harness.cli.config import compose, engine_name, run_spec
from harness.spec import InvalidSpec, apply_stack, config_id
from harness.spec.stacks import STACKS


def test_auto_is_harness_on_the_cpu_and_torchtitan_on_a_gpu():
    cpu, resolved = apply_stack(compose(["model=tiny"]))
    assert resolved.name == "harness" and resolved.requested == "auto" and resolved.engine == "torch"
    assert cpu["train"]["grad_sync"] == "last" and cpu["train"]["recompute"] == "none"
    gpu, resolved = apply_stack(compose(["model=tiny", "device=h100_80gb"]))
    assert resolved.name == "torchtitan"
    assert gpu["train"]["grad_sync"] == "every_microbatch"
    assert gpu["parallel"]["fsdp_reshard_after_forward"] == "default"
    assert gpu["train"]["recompute"] == "op"
    assert resolved.line().startswith("stack: torchtitan (auto: a GPU device) · engine torch · ")


def test_a_key_the_user_sets_wins_and_is_said():
    cfg = compose(["model=tiny", "device=h100_80gb", "train.recompute=full"])
    resolved_cfg, resolved = apply_stack(cfg)
    assert resolved_cfg["train"]["recompute"] == "full"
    assert resolved.overridden == ("train.recompute",)
    assert "train.recompute=full (set)" in resolved.line()
    # the composed config itself is left as it was (null stays null for the next reader)
    assert cfg["train"]["grad_sync"] is None


def test_megatron_takes_its_engine_unless_one_is_named():
    assert engine_name(compose(["model=tiny", "stack=megatron"])) == "megatron"
    assert engine_name(compose(["model=tiny", "stack=megatron", "engine=torch"])) == "torch"
    assert engine_name(compose(["model=tiny", "device=h100_80gb"])) == "torch"


def test_an_unknown_stack_names_the_known_ones():
    with pytest.raises(InvalidSpec, match="stack='titan' must be one of auto, torchtitan, megatron, harness"):
        run_spec(compose(["model=tiny", "stack=titan"]))


def test_the_torchtitan_choices_change_the_spec_and_its_id():
    harness = run_spec(compose(["model=tiny", "device=h100_80gb", "stack=harness", "parallel.dp=2"]))
    titan = run_spec(compose(["model=tiny", "device=h100_80gb", "stack=torchtitan", "parallel.dp=2"]))
    assert (harness.train.recompute, titan.train.recompute) == ("none", "op")
    assert config_id(harness) != config_id(titan)
    assert set(STACKS) == {"torchtitan", "megatron", "harness"}


def test_every_command_says_the_stack_and_json_carries_it():
    for command in ("estimate", "plan"):
        out = harness_cli(command, "model=llama3_8b", "format=json", "plan.gpus=8")
        assert out.returncode == 0, out.stderr
        stack = json.loads(out.stdout)["stack"]
        assert stack["name"] == "torchtitan" and stack["choices"]["train.grad_sync"] == "every_microbatch"
        table = harness_cli(command, "model=llama3_8b", "plan.gpus=8")
        assert table.stdout.splitlines()[1].startswith("stack: torchtitan (auto: a GPU device)")


def test_run_and_sweep_refuse_a_stack_this_runner_cannot_run():
    for command in ("run", "sweep"):
        out = harness_cli(command, "model=tiny", "stack=megatron", "results_dir=/nonexistent/never-written")
        assert out.returncode == 2
        assert "stack=megatron: this runner cannot" in out.stderr and "Traceback" not in out.stderr


def test_the_same_overrides_are_one_configuration_in_estimate_and_run(tmp_path):
    # A GPU-scale model takes the published study's device and shape in every command (issue 28: estimate
    # and plan took 8 micro-batches while run took one: two config_ids for one set of overrides). On this
    # machine the run is an invalid record (no CUDA), which carries the config_id all the same.
    args = ("model=llama3_8b", "parallel.dp=2", "parallel.zero_stage=3", "format=json")
    est = json.loads(harness_cli("estimate", *args).stdout)
    run = harness_cli("run", *args, f"results_dir={tmp_path}")
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["config_id"] == est["config_id"]
    assert record["device_name"] == "h100_94gb" and record["train_num_microbatches"] == 1  # no pipeline: one
    assert record["stack"]["name"] == "torchtitan" and record["train_grad_sync"] == "last"  # m = 1: no choice
