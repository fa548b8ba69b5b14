"""plan's reverse questions (plan.solve) and plan.emit's study file (issue 16, items 5 and 6)."""

from __future__ import annotations

import dataclasses
import json

import yaml
from conftest import harness_cli, spec

from harness.cli.config import compose, run_spec
from harness.cli.main import main
from harness.estimate import estimate
from harness.estimate.plan import PlanOptions, plan
from harness.estimate.solve import device_counts, max_micro_batch, max_seq_len, min_gpus, seq_granule
from harness.spec import config_id

GIB = 2**30
# Llama-3-8B, tp 2 × dp 4 with ZeRO-3, sequence 4096, 2 micro-batches: every activation term is
# linear in the micro-batch, and in the sequence past its first few granules.
BASE = spec(
    "llama3_8b",
    "h100_80gb",
    parallel_tp=2,
    parallel_dp=4,
    parallel_zero_stage=3,
    train_seq_len=4096,
    train_num_microbatches=2,
)


def _total(s, **train) -> int:
    """The device level the verdict is judged on (allocated + reserved terms + memory outside)."""
    return estimate(dataclasses.replace(s, train=dataclasses.replace(s.train, **train))).device_total_bytes


def _with_capacity(s, capacity_bytes: float):
    """``s`` on a device whose 80 % threshold is at ``capacity_bytes`` (memory_gib = bytes / 0.8 / 2^30)."""
    return dataclasses.replace(s, device=dataclasses.replace(s.device, memory_gib=capacity_bytes / 0.8 / GIB))


def test_device_counts():
    # powers of two below a node (whole nodes are then doubled and bisected by min_gpus)
    assert device_counts(8, 40) == [1, 2, 4]
    assert device_counts(4, 12) == [1, 2]
    assert device_counts(8, 2) == [1, 2]


def test_seq_granule():
    # 128 tokens, made a multiple of 2·cp (balanced) and of cp·tp (sequence parallel):
    # cp 3, tp 2: lcm(128, 2·3 = 6, 3·2 = 6) = 384; cp 1, tp 3: lcm(128, 3) = 384; cp 1, tp 1: 128
    assert seq_granule(dataclasses.replace(BASE, parallel=dataclasses.replace(BASE.parallel, cp=3))) == 384
    assert seq_granule(dataclasses.replace(BASE, parallel=dataclasses.replace(BASE.parallel, tp=3))) == 384
    assert seq_granule(spec("tiny")) == 128


def test_largest_micro_batch_on_a_device_sized_for_it():
    e = {b: _total(BASE, micro_batch_size=b) for b in range(1, 9)}
    # Increasing in b, though not linearly: where the accumulated FP32 gradients land in activation
    # blocks depends on the blocks' sizes (loss_cache.accumulated_grad_segments: 0 at b 1 and 2, 3.25
    # GiB at 3, 1 GiB at 4), which is why the search bisects rather than extrapolates.
    assert all(e[b] < e[b + 1] for b in range(1, 8))
    # threshold · capacity halfway between E(5) and E(6): 5 fits, 6 does not -> 5
    s = _with_capacity(BASE, (e[5] + e[6]) / 2)
    solution = max_micro_batch(s, PlanOptions(gpus=8))
    assert solution.answer == 5
    assert solution.best.predicted_bytes == e[5] and solution.best.fits
    assert solution.over.estimate.spec.train.micro_batch_size == 6 and not solution.over.fits
    assert solution.tried == (1, 2, 4, 8, 6, 5)  # doubling to the first misfit, then bisection
    # below E(1): nothing fits, and the answer says how much micro-batch 1 needs
    none = max_micro_batch(_with_capacity(BASE, e[1] - 1), PlanOptions(gpus=8))
    assert none.answer is None and none.over.predicted_bytes == e[1]


def test_longest_sequence_on_a_device_sized_for_it():
    step = seq_granule(BASE)  # 128 (tp 2 divides it, cp 1)
    e20, e21 = _total(BASE, seq_len=20 * step), _total(BASE, seq_len=21 * step)
    # threshold · capacity halfway between E(20·128) and E(21·128): 2560 tokens fit, 2688 do not
    s = _with_capacity(BASE, (e20 + e21) / 2)
    solution = max_seq_len(s, PlanOptions(gpus=8))
    assert solution.answer == 2560 and solution.best.estimate.spec.train.seq_len == 2560
    assert solution.over.estimate.spec.train.seq_len == 2688 and not solution.over.fits


def test_fewest_devices_fit_and_the_count_before_does_not():
    base = spec("llama3_70b", "h100_80gb", train_seq_len=8192)
    opts = PlanOptions(gpus=8, micro_batch_sizes=(1,), recompute=("full",))
    solution = min_gpus(base, opts, max_gpus=64)
    n = solution.answer
    # The states are 16 B a parameter (FP32 weights 4, FP32 gradients 4, two FP32 Adam moments 8), at best
    # spread evenly: 70.6e9 · 16 / (0.8 · 79.65 GiB) = 16.5 devices is a floor for any layout
    assert n >= 17 and n % 8 == 0
    assert solution.best.fits and solution.plan.fitting[0] is solution.best
    assert plan(base, dataclasses.replace(opts, gpus=n - 8)).fitting == ()  # the whole node before
    # below a node 1, 2, 4; then 8, 16, 32 (doubling) and the bisection between the last two
    assert solution.tried[:3] == (1, 2, 4) and n in solution.tried and len(solution.tried) <= 9


def test_solve_on_the_command_line(capsys):
    args = ["plan", "model=llama3_8b", "parallel.tp=2", "parallel.dp=4", "parallel.zero_stage=3"]
    assert main([*args, "plan.solve=max_micro_batch", "format=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["solve"] == "max_micro_batch" and out["answer"] >= 1
    assert out["best"]["fits"] and not out["over"]["fits"]
    assert out["over"]["train_micro_batch_size"] == out["answer"] + 1
    assert main([*args, "plan.solve=max_seq_len"]) == 0
    assert "longest sequence that fits: " in capsys.readouterr().out
    assert main([*args, "plan.solve=biggest"]) == 2
    assert "plan.solve='biggest' must be null or one of min_gpus" in capsys.readouterr().err


def test_emitted_study_is_swept_as_it_is(tmp_path, capsys):
    path = tmp_path / "plans" / "study" / "l8b.yaml"
    overrides = ["model=llama3_8b", "device=h100_80gb", "plan.gpus=8", "plan.top=4", "format=json"]
    assert main(["plan", *overrides, f"plan.emit={path}"]) == 0
    captured = capsys.readouterr()
    ranked = json.loads(captured.out)["layouts"][:4]
    command = captured.err.strip().splitlines()[-1].split("measure them: ")[1]
    assert command == f"harness sweep hydra.searchpath=[file://{tmp_path / 'plans'}] +study=l8b"
    study = yaml.safe_load(path.read_text())
    grids = study["hydra"]["sweeper"]["grids"]
    # each grid point, composed the way the sweeper composes it, is the layout plan ranked there
    for grid, row in zip(grids, ranked, strict=True):
        point = [f"{k}={v}" for k, v in grid.items()]
        cfg = compose([command.split()[2], "+study=l8b", *point])
        assert config_id(run_spec(cfg)) == row["config_id"]
    # and the sweeper's dry run takes the file as it is
    r = harness_cli(
        *command.split()[1:], "sweep.dry_run=true", f"results_dir={tmp_path / 'results'}", timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "harness sweep: 4 points: 4 to launch" in r.stdout


def test_emitted_study_keeps_each_layouts_recompute_every():
    """Every N-th block checkpointed is a layout's own setting: a study whose first layout is not
    ``full`` (its recompute_every canonical 1) must still give the full layout its N."""
    from harness.cli.emit import study_text
    from harness.spec import canonical

    op = canonical(dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, recompute="op")))
    every2 = canonical(
        dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, recompute="full", recompute_every=2))
    )
    study = yaml.safe_load(study_text([op, every2], name="x", how="test", command="harness sweep +study=x"))
    grids = study["hydra"]["sweeper"]["grids"]
    assert [g["train.recompute"] for g in grids] == ["op", "full"]
    assert [g["train.recompute_every"] for g in grids] == [1, 2]
    assert "recompute_every" not in study["train"]


def test_emit_path_must_be_a_study_folder(tmp_path, capsys):
    assert main(["plan", "model=small", "device.memory_gib=1", f"plan.emit={tmp_path}/my_plan.yaml"]) == 2
    captured = capsys.readouterr()
    assert "write it as DIR/study/NAME.yaml" in captured.err and captured.out == ""  # before any work
