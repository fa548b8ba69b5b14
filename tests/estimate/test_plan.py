"""plan: the candidates it enumerates, its accounting, its ranking and its option checks."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import spec

from harness.estimate.plan import PlanOptions, candidate_groups, candidates, plan
from harness.spec import canonical, canonical_form, layout_problems, problems


def test_candidates_are_canonical_and_cover_every_degree_split():
    base = spec("tiny")
    opts = PlanOptions(
        gpus=4, micro_batch_sizes=(1,), zero_stages=(0,), recompute=("none",), pp_schedules=("1f1b",)
    )
    layouts = {(s.parallel.dp, s.parallel.tp, s.parallel.pp, s.parallel.cp) for s in candidates(base, opts)}
    # Every (dp, tp, pp, cp) with product 4 = 2²: exponents summing to 2 over 4 slots, C(5, 3) = 10.
    assert len(layouts) == 10
    assert all(d * t * p * c == 4 for d, t, p, c in layouts)
    for s in candidates(base, opts):
        if not problems(s):
            assert canonical_form(s) == s


def test_plan_names_each_layout_by_its_config_id():
    # The JSON output names rows without validating them again (canonical_config_id): the same ids.
    from harness.cli.render.plan import plan_json
    from harness.spec import config_id

    result = plan(spec("tiny"), PlanOptions(gpus=4))
    rows = plan_json(result, PlanOptions(gpus=4))["layouts"]
    assert rows and [r["config_id"] for r in rows] == [config_id(r.estimate.spec) for r in result.fitting]


def test_groups_share_validity():
    # plan validates one spec per group: every member must agree with it.
    for group in candidate_groups(spec("tiny"), PlanOptions(gpus=8)):
        verdicts = {not layout_problems(s) for s in group}
        assert len(verdicts) == 1


def test_groups_share_validity_for_a_mixture_of_experts_over_every_expert_degree():
    # Expert parallelism adds ep to the layouts: every degree dividing the experts and dp·cp, never
    # with ZeRO-1 and never a one-rank expert unit under op (both refused by validation); a group's
    # members still agree on validity, and a dense model keeps ep 1.
    opts = PlanOptions(gpus=8, micro_batch_sizes=(1,), recompute=("none", "op"))
    seen = set()
    for group in candidate_groups(spec("tiny_moe"), opts):
        verdicts = {not layout_problems(s) for s in group}
        assert len(verdicts) == 1
        for s in group:
            p = s.parallel
            seen.add((p.dp * p.cp, p.ep))
            assert p.ep == 1 or (p.zero_stage != 1 and (p.dp * p.cp) % p.ep == 0)
    assert {(8, 1), (8, 2), (8, 4), (8, 8), (4, 4), (2, 2), (1, 1)} <= seen
    assert {s.parallel.ep for s in candidates(spec("tiny"), opts)} == {1}
    fixed = PlanOptions(gpus=8, micro_batch_sizes=(1,), fixed=(("ep", 4),))
    assert {s.parallel.ep for s in candidates(spec("tiny_moe"), fixed)} == {4}


def test_accounting_adds_up_and_fitting_rows_come_first_ranked():
    base = spec("llama3_8b", "h100_80gb", train_seq_len=4096)
    result = plan(base, PlanOptions(gpus=16))
    assert result.considered == len(list(candidates(base, PlanOptions(gpus=16))))
    assert result.considered == result.invalid + len(result.rows)
    n_fit = len(result.fitting)
    assert 0 < n_fit < len(result.rows)
    assert all(r.fits for r in result.rows[:n_fit]) and not any(r.fits for r in result.rows[n_fit:])
    times = [r.cost.step_time_s for r in result.fitting]
    assert times == sorted(times)
    assert all(r.estimate.utilisation <= 0.8 for r in result.fitting)


def test_fixed_global_batch():
    result = plan(
        spec("llama3_8b", "h100_80gb", train_seq_len=4096), PlanOptions(gpus=16, global_batch_size=64)
    )
    for row in result.rows:
        assert row.estimate.spec.global_batch_size == 64


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(gpus=0), "plan.gpus=0"),
        (dict(zero_stages=(4,)), "plan.zero_stages=[4] has invalid"),
        (dict(recompute=("most",)), "plan.recompute=['most']"),
        (dict(micro_batch_sizes=()), "plan.micro_batch_sizes=[] has invalid or no values"),
        (dict(engine="guess"), "engine 'guess'"),
    ],
)
def test_bad_options_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PlanOptions(**{"gpus": 8, **kw})


def test_interleaved_middle_ranks_can_be_the_most_loaded_and_plan_computes_them():
    """Interleaved 1F1B keeps a rank's sent tensors until the step ends, more the later the rank
    (pipeline.interleaved_sends_kept), so a middle rank can hold the most: Llama-2-7B, pp 8 × v 2, 32
    micro-batches of s 4096, full recomputation, has its worst rank in the middle (rank 1 since the
    checkpoints' inputs are counted FP32 under autocast; rank 6 before). ``plan``'s few dominant
    stages missed it (a hypothesis example found it: 31.4 GB against 32.0 GB); interleaved layouts
    now compute every stage."""
    from conftest import spec

    from harness.estimate import estimate
    from harness.estimate.core import estimate_canonical
    from harness.estimate.peaks import dominant_stages

    s = spec(
        "llama2_7b",
        "a100_40gb",
        parallel_pp=8,
        parallel_pp_schedule="interleaved_1f1b",
        parallel_virtual_stages=2,
        train_num_microbatches=32,
        train_recompute="full",
        train_seq_len=4096,
    )
    every = estimate(s)
    assert every.worst.stage not in (0, 7)
    assert dominant_stages(s.parallel, s.train) == tuple(range(8))
    few = estimate_canonical(s, stages=dominant_stages(s.parallel, s.train))
    assert few.total_bytes == every.total_bytes


def test_the_first_expert_stage_after_dense_first_layers_is_among_the_dominant_stages():
    # Qwen3-30B-A3B with its first 12 blocks dense over pp 8 (6 blocks a stage): stages 0 and 1 dense,
    # stage 2 the first of the expert stages and, with 6 micro-batches in flight, the most loaded; the
    # stages 0, 1 and the last alone missed it (issue 27)
    from harness.estimate import estimate
    from harness.estimate.core import estimate_canonical
    from harness.estimate.peaks import dominant_stages

    s = spec(
        "qwen3_30b_a3b",
        "h100_80gb",
        parallel_pp=8,
        parallel_dp=8,
        parallel_zero_stage=1,
        train_num_microbatches=8,
        train_precision="bf16",
        train_seq_len=8192,
    )
    s = canonical(dataclasses.replace(s, model=dataclasses.replace(s.model, moe_dense_layers=12)))
    every = estimate(s)
    assert every.worst.stage == 2
    assert 2 in dominant_stages(s.parallel, s.train, s.model)
    assert 2 not in dominant_stages(s.parallel, s.train)  # (without the model: its blocks unknown)
    few = estimate_canonical(s, stages=dominant_stages(s.parallel, s.train, s.model))
    assert few.total_bytes == every.total_bytes


def test_candidates_carry_the_stack_choices_in_canonical_form():
    # torchtitan's reshard policy: ZeRO-3 under pipelining is ZeRO-2 (listed once), ZeRO-3 over several
    # ranks without a pipeline keeps its "default" (the head unit); grad_sync every_microbatch only where
    # it is a choice. Every candidate equals its canonical form (one config_id per run).
    import dataclasses

    base = spec("tiny", "h100_80gb", train_grad_sync="every_microbatch")
    base = dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, fsdp_reshard_after_forward="default")
    )
    opts = PlanOptions(gpus=8, micro_batch_sizes=(1,), recompute=("none",), global_batch_size=16)
    seen = list(candidates(base, opts))
    for s in seen:
        if not problems(s):
            assert canonical_form(s) == s
    assert not [s for s in seen if s.parallel.pp > 1 and s.parallel.zero_stage == 3]
    zero3 = [s for s in seen if s.parallel.zero_stage == 3]
    assert zero3 and all(s.parallel.fsdp_reshard_after_forward == "default" for s in zero3)
    keys = [(s.parallel, s.train) for s in seen]
    assert len(keys) == len(set(keys))  # no run listed twice


def test_zero_stages_over_one_rank_are_one_layout():
    # Issue 31: ZeRO 0-3 at dp·cp = 1 were four rows of one run.
    opts = PlanOptions(gpus=2, micro_batch_sizes=(1,), recompute=("none",), pp_schedules=("1f1b",))
    tp2 = [s for s in candidates(spec("tiny"), opts) if s.parallel.tp == 2]
    assert [s.parallel.zero_stage for s in tp2] == [0]
    dp2 = [s for s in candidates(spec("tiny"), opts) if s.parallel.dp == 2]
    assert sorted(s.parallel.zero_stage for s in dp2) == [0, 1, 2, 3]


def test_given_axes_constrain_the_plan():
    # Issue 31: parallel.tp=8 parallel.pp=4 given to plan were silently ignored.
    import json

    from conftest import harness_cli

    r = harness_cli(
        "plan",
        "model=llama3_70b",
        "device=h100_80gb",
        "plan.gpus=32",
        "parallel.tp=8",
        "parallel.pp=4",
        "parallel.zero_stage=1",
        "format=json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["given"] == ["parallel.tp=8", "parallel.pp=4", "parallel.zero_stage=1"]
    assert out["layouts"] and all(
        (x["parallel_tp"], x["parallel_pp"], x["parallel_zero_stage"]) == (8, 4, 1) for x in out["layouts"]
    )
    table = harness_cli("plan", "model=llama3_70b", "device=h100_80gb", "plan.gpus=32", "parallel.tp=8")
    assert "given: parallel.tp=8: only layouts with these are considered" in table.stdout


def test_plan_verify_traces_the_top_layouts_against_the_card(tmp_path):
    # Issue 32 item 6: plan.verify=N traces the top N fitting layouts in fake mode, replays each trace
    # against the card and prints the estimate's and the trace's figures side by side; progress on stderr.
    import json

    from conftest import harness_cli

    r = harness_cli(
        "plan",
        "model=tiny",
        "device=h100_80gb",
        "plan.gpus=2",
        "plan.verify=2",
        "format=json",
        f"run.fake_cache={tmp_path}",
    )
    assert r.returncode == 0, r.stderr
    verified = json.loads(r.stdout)["verified"]
    assert [v["plan_rank"] for v in verified] == [1, 2]  # both fit: the plan's order
    for v in verified:
        assert v["status"] == "ok" and v["capacity_verdict"] == "fits" and v["num_alloc_retries"] == 0
        assert v["traced_allocated_bytes"] == pytest.approx(v["est_total_bytes"], rel=0.05)
        assert v["replayed_reserved_bytes"] >= v["traced_allocated_bytes"]
    assert "plan.verify 1/2: tracing" in r.stderr and "plan.verify 2/2: tracing" in r.stderr


def test_plan_verify_ranks_by_what_the_card_does(monkeypatch):
    from harness.cli import plan as plan_cli
    from harness.runner.fake import run as fake_run

    result = plan(spec("tiny", "h100_80gb"), PlanOptions(gpus=2))
    verdicts = iter(["oom_fragmentation", "fits_after_flush", "fits"])

    def fake(spec_, **kwargs):
        return {"status": "ok", "peak_allocated_bytes": 1, "sim_capacity_verdict": next(verdicts)}

    monkeypatch.setattr(fake_run, "run_fake", fake)
    out = plan_cli._verify(result, 3, {"run": {"timeout_s": 60, "fake_cache": None}})
    assert [rank for rank, _, _ in out] == [3, 2, 1]


def test_plan_show_all_lists_what_does_not_fit_with_the_term_that_breaks_it():
    # Issue 31: layouts that do not fit were invisible. Llama-3-70B on 8 H100 80 GB: nothing fits; the
    # smallest is ZeRO-3 over 8 ranks, whose states alone (16 B a parameter / 8) pass 80 % of the card
    # at the optimizer term.
    from conftest import harness_cli

    r = harness_cli(
        "plan", "model=llama3_70b", "device=h100_80gb", "plan.gpus=8", "plan.top=3", "plan.show=all"
    )
    assert r.returncode == 0, r.stderr
    assert "nothing fits; the smallest needs" in r.stdout and "over at optimizer" in r.stdout
    rows = r.stdout.split("with the term that breaks the budget:")[1].strip().splitlines()[1:]
    assert len(rows) == 3 and all(" over at " in row for row in rows)


def test_the_proxy_step_time_is_a_lower_bound_and_its_mfu_an_upper_one():
    from conftest import harness_cli

    r = harness_cli("plan", "model=llama3_70b", "device=h100_80gb", "plan.gpus=64", "plan.top=2")
    header = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("#"))
    assert header.split()[-2:] == ["s≥", "MFU≤"]
    first = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("1 "))
    assert first.endswith("%") and 0 < int(first.split()[-1].rstrip("%")) <= 100


def test_expert_parallelism_costs_its_all_to_alls_and_reduces_experts_over_their_own_ranks():
    from harness.estimate.comm import cost

    dense_8b = cost(spec("llama3_8b", "h100_80gb", parallel_dp=8, parallel_zero_stage=3))
    n = 8_030_261_248  # Llama-3-8B: FSDP2 moves 7/8 of it gathered twice in BF16, reduced in FP32
    assert dense_8b.dp_bytes == pytest.approx(7 / 8 * n * (2 * 2 + 4)) and dense_8b.ep_bytes == 0

    def mixtral(ep):
        return cost(spec("mixtral_8x7b", "h100_80gb", parallel_dp=8, parallel_ep=ep, parallel_zero_stage=3))

    # Each MoE layer's T·k routed rows (T = 256 tokens, k = 2) go out and back, forward and backward:
    # 32 layers · 4 · 512 rows · h 4096 · 2 B · 7/8.
    assert mixtral(8).ep_bytes == pytest.approx(32 * 4 * 512 * 4096 * 2 * 7 / 8)
    # ep 8 over dp 8: each rank alone holds its expert, whose gradient crosses no link.
    assert mixtral(8).dp_bytes < mixtral(2).dp_bytes < mixtral(1).dp_bytes


@pytest.mark.parametrize("calibrated", [False, True])
def test_layouts_over_at_the_allocated_level_get_their_device_level_only_when_asked(calibrated):
    """plan skips the reserved terms of a layout whose allocated level (and the memory outside the
    allocator) is over the threshold already: its verdict cannot change, and its device level, asked
    later, is the one the full computation gives."""
    from harness.analysis.profile import load_profile
    from harness.estimate.core import estimate_canonical
    from harness.estimate.levels import verdict_bytes, verdict_floor

    profile = load_profile("results/paper_fake/h100_94gb/calibration.json") if calibrated else None
    base = spec("llama3_8b", "h100_80gb", train_seq_len=8192)
    result = plan(base, PlanOptions(gpus=16, calibration=profile))
    deferred = [r for r in result.rows if r.device_bytes is None]
    assert deferred and not any(r.fits for r in deferred)
    floors = [r.floor_bytes for r in result.rows[len(result.fitting) :]]
    assert floors == sorted(floors)
    for row in [*deferred[:: max(1, len(deferred) // 40)], *result.fitting[:20]]:
        est = estimate_canonical(row.estimate.spec)
        allocated = None if profile is None else profile.total_bytes(est)
        exact = verdict_bytes(est, profile, allocated=allocated)
        assert verdict_floor(est, allocated) <= exact
        assert row.predicted_bytes == exact
        assert row.fits == (exact <= 0.8 * est.capacity_bytes)
