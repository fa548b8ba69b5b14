"""``plan.include`` (issue 31 item 3): where the user's own layout ranks among the fitting ones, or the
term that breaks the budget; a key plan does not know is one line, exit 2."""

from __future__ import annotations

import json

from conftest import harness_cli

PLAN = ("plan", "model=llama3_8b", "device=h100_80gb", "plan.gpus=8", "calibration=none")


def test_the_first_ranked_layout_ranks_first_and_a_layout_that_does_not_fit_is_named():
    done = harness_cli(*PLAN, "format=json")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)["layouts"][0]
    layout = (
        f"{{dp:{first['parallel_dp']},tp:{first['parallel_tp']},pp:{first['parallel_pp']},"
        f"cp:{first['parallel_cp']},zero_stage:{first['parallel_zero_stage']},"
        f"micro_batch_size:{first['train_micro_batch_size']},recompute:{first['train_recompute']}}}"
    )
    ranked = harness_cli(*PLAN, f"plan.include={layout}", "format=json")
    assert ranked.returncode == 0, ranked.stderr
    included = json.loads(ranked.stdout)["included"]
    assert included["rank"] == 1 and included["config_id"] == first["config_id"]
    # one GPU's worth of Llama-3-8B without sharding or recomputation at micro-batch 8 does not fit
    over = harness_cli(*PLAN, "plan.include={dp:8,zero_stage:0,micro_batch_size:1,recompute:none}")
    assert over.returncode == 0, over.stderr
    assert "your layout (plan.include): dp=8 tp=1 pp=1 cp=1 zero=0" in over.stdout
    assert "does NOT fit" in over.stdout and "over at optimizer" in over.stdout


def test_a_layout_plan_cannot_build_is_one_line():
    unknown = harness_cli(*PLAN, "plan.include={tq:2}")
    assert unknown.returncode == 2
    assert (
        unknown.stderr.strip()
        .splitlines()[-1]
        .startswith("harness plan: error: plan.include: unknown key(s) tq")
    )
    split = harness_cli(*PLAN, "plan.include={tp:3}")
    assert split.returncode == 2
    assert "tp·pp·cp = 3·1·1 does not divide plan.gpus=8" in split.stderr
