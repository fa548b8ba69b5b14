"""`harness plan`: every layout that fits, ranked; the reverse questions (plan.solve=); plan.emit=."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence

from harness.cli.config import engine_name, run_spec
from harness.cli.shared import (
    compose_scaled,
    fails_on_nofit,
    output_settings,
    profile_of_config,
    stack_of_config,
    step_time_of_config,
)
from harness.spec.validate import MAX_RANKS


def plan_command(overrides: Sequence[str]) -> int:
    from harness.cli.render.common import json_envelope, with_stack
    from harness.cli.render.plan import include_json, include_lines, plan_json, plan_table
    from harness.estimate.plan import PlanOptions, include_rank, plan

    cfg = compose_scaled(overrides)
    fmt, threshold = output_settings(cfg)
    fail_on_nofit = fails_on_nofit(cfg)
    p = cfg["plan"]
    narrowed, fixed, given = _plan_constraints(cfg, overrides)
    opts = PlanOptions(
        gpus=_whole(p["gpus"], "plan.gpus", MAX_RANKS),
        global_batch_size=p["global_batch_size"],
        micro_batch_sizes=tuple(p["micro_batch_sizes"]),
        zero_stages=tuple(p["zero_stages"]),
        recompute=tuple(p["recompute"]),
        pp_schedules=tuple(p["pp_schedules"]),
        virtual_stages=tuple(p["virtual_stages"]),
        max_tp=_whole(p["max_tp"], "plan.max_tp", MAX_RANKS),
        threshold=threshold,
        engine=engine_name(cfg),
        calibration=profile_of_config(cfg),
        step_time=step_time_of_config(cfg),
        fixed=fixed,
        given=given,
    )
    if narrowed and p.get("solve") is None:
        opts = dataclasses.replace(opts, **narrowed)
    _whole(p["top"], "plan.top", 10**9)  # rows printed
    show = p.get("show") or "fitting"
    if show not in ("fitting", "all"):
        raise ValueError(f"plan.show={show!r} must be fitting or all")
    verify = p.get("verify") or 0
    if verify:
        _whole(verify, "plan.verify", 64)
    if p.get("emit"):  # a path Hydra could not find as a study fails before the work, not after
        from harness.cli.config import config_dir
        from harness.cli.emit import study_target

        study_target(p["emit"], config_dir())
    if p.get("solve") is not None:
        found = _plan_solve(cfg, opts, fmt)
        return 1 if fail_on_nofit and not found else 0
    base = run_spec(cfg)
    included = _included_row(base, opts, p.get("include"))  # checked before the work
    result = plan(base, opts)
    verified = _verify(result, int(verify), cfg) if verify else None
    rank = include_rank(result, included) if included is not None else None
    if fmt == "json":
        out = {"stack": stack_of_config(cfg).as_record(), **plan_json(result, opts)}
        if included is not None:
            out["included"] = include_json(included, rank)
        if verified is not None:
            out["verified"] = [_verified_fields(rank, row, rec) for rank, row, rec in verified]
        print(json.dumps(json_envelope(out), indent=2))
    else:
        print(
            with_stack(
                plan_table(
                    result, opts, top=int(p["top"]), explain=bool(cfg.get("explain")), show_all=show == "all"
                ),
                stack_of_config(cfg),
            )
        )
        if included is not None:
            print("\n" + "\n".join(include_lines(included, rank, result, opts)))
        if verified is not None:
            print("\n" + _verified_table(verified))
    _emit(cfg, [r.estimate.spec for r in result.fitting[: int(p["top"])]], fmt, opts)
    return 1 if fail_on_nofit and not result.fitting else 0


def _included_row(base, opts, layout):
    """``plan.include={tp: 2, pp: 4, ...}``: the user's own layout, judged and ranked as plan's
    candidates are (None when not given). A key plan does not know, or an impossible layout, is a
    usage error before the work (the spec check's own message)."""
    if layout is None:
        return None
    from harness.estimate.plan import include_spec, plan_row
    from harness.spec import canonical

    if not isinstance(layout, dict):
        raise ValueError(f"plan.include={layout!r} must be a layout such as '{{tp:2,pp:4,zero_stage:1}}'")
    spec = canonical(include_spec(base, opts, layout))
    timer = opts.step_time if opts.step_time is not None and opts.step_time.applies_to(base) else None
    return plan_row(spec, opts, timer=timer)


# What `plan` takes from the command line as a constraint (issue 31: parallel.tp=8 parallel.pp=4 were
# silently ignored): the degrees fix an axis; the others narrow plan's own list to the given value.
PLAN_AXES = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep")
PLAN_NARROWS = {
    "parallel.zero_stage": "zero_stages",
    "parallel.pp_schedule": "pp_schedules",
    "parallel.virtual_stages": "virtual_stages",
    "train.micro_batch_size": "micro_batch_sizes",
    "train.recompute": "recompute",
}


def _plan_constraints(cfg: dict, overrides: Sequence[str]) -> tuple[dict, tuple, tuple[str, ...]]:
    """The PlanOptions lists narrowed, the axes fixed and the overrides that did it, from the keys of
    PLAN_AXES and PLAN_NARROWS given on the command line (their values as composed)."""
    named = {o.partition("=")[0].lstrip("+~") for o in overrides if "=" in o}
    narrowed, fixed, given = {}, [], []
    for key in (*PLAN_AXES, *PLAN_NARROWS):
        if key not in named:
            continue
        section, field = key.split(".")
        value = cfg[section][field]
        if value is None:
            continue
        given.append(f"{key}={value}")
        if key in PLAN_AXES:
            fixed.append((field, _whole(value, key, MAX_RANKS)))
        else:
            narrowed[PLAN_NARROWS[key]] = (value,)
    return narrowed, tuple(fixed), tuple(given)


def _whole(value, key: str, most: int) -> int:
    """A count given on the command line: a whole number from 1 to ``most`` (issue 29: plan.gpus=1.5
    was silently 1, plan.max_gpus=10**12 ran out of memory)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value != int(value)
    ):
        raise ValueError(f"{key}={value!r} must be a whole number")
    if not 1 <= value <= most:
        raise ValueError(f"{key}={value!r} must be from 1 to {most:,}")
    return int(value)


def _plan_solve(cfg: dict, opts, fmt: str) -> bool:
    """``plan.solve=min_gpus|max_micro_batch|max_seq_len``: a reverse question (harness.estimate.solve);
    whether it found an answer."""
    from harness.cli.render.common import json_envelope
    from harness.cli.render.plan import solve_json, solve_table
    from harness.estimate import solve as sv

    p, question, base = cfg["plan"], cfg["plan"]["solve"], run_spec(cfg)
    if question == "min_gpus":
        solution = sv.min_gpus(base, opts, max_gpus=_whole(p["max_gpus"], "plan.max_gpus", MAX_RANKS))
    elif question == "max_micro_batch":
        solution = sv.max_micro_batch(base, opts)
    elif question == "max_seq_len":
        solution = sv.max_seq_len(base, opts)
    else:
        raise ValueError(f"plan.solve={question!r} must be null or one of {', '.join(sv.QUESTIONS)}")
    top = int(p["top"])
    if fmt == "json":
        out = {"stack": stack_of_config(cfg).as_record(), **solve_json(solution, opts)}
        print(json.dumps(json_envelope(out), indent=2))
    else:
        from harness.cli.render.common import with_stack

        print(
            with_stack(
                solve_table(solution, opts, top=top, explain=bool(cfg.get("explain"))), stack_of_config(cfg)
            )
        )
    if solution.plan is not None:
        specs = [r.estimate.spec for r in solution.plan.fitting[:top]]
    else:
        specs = [] if solution.best is None else [solution.best.estimate.spec]
    _emit(cfg, specs, fmt, opts)
    return solution.best is not None


def _emit(cfg: dict, specs: list, fmt: str, opts) -> None:
    """``plan.emit=DIR/study/NAME.yaml``: the layouts as a study for ``harness sweep``, and the command."""
    path = cfg["plan"].get("emit")
    if not path:
        return
    from harness.cli.config import config_dir
    from harness.cli.emit import write_study

    how = ""
    if specs:
        first = specs[0]
        how = (
            f"{first.model.name} on {first.parallel.world} × {first.device.name}, engine {opts.engine}, "
            f"threshold {opts.threshold:g}"
        )
    target, command = write_study(path, specs, how=how, config_dir=config_dir())
    out = sys.stderr if fmt == "json" else sys.stdout
    print(f"study: {target} ({len(specs)} layouts); measure them: {command}", file=out)


# What the card does with a trace, best first (harness.alloc.CAPACITY_VERDICTS); no verdict (a trace
# that failed) last.
_CARD_ORDER = ("fits", "fits_after_flush", "oom_fragmentation", "oom_allocated", None)


def _verify(result, n: int, cfg: dict) -> list[tuple[int, object, dict]]:
    """``plan.verify=N`` (issue 32): the top N fitting layouts traced in fake mode, each rank's trace
    replayed against the card's capacity; ranked by what the card does with them, then by the plan's
    rank. Progress on stderr, one line a layout."""
    import time

    from harness.cli.render.common import layout_line
    from harness.runner.fake.run import run_fake
    from harness.sweep.launch import run_timeout

    rows = result.fitting[:n]
    out = []
    for rank, row in enumerate(rows, 1):
        spec = row.estimate.spec
        print(f"plan.verify {rank}/{len(rows)}: tracing {layout_line(spec)} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        rec = run_fake(spec, timeout_s=run_timeout(cfg), cache=cfg["run"].get("fake_cache"))
        verdict = rec.get("sim_capacity_verdict") or rec["status"]
        print(f"  {verdict} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
        out.append((rank, row, rec))
    return sorted(out, key=lambda x: (_CARD_ORDER.index(x[2].get("sim_capacity_verdict")), x[0]))


def _verified_fields(rank: int, row, rec: dict) -> dict:
    est = row.estimate
    return {
        "plan_rank": rank,
        "config_id": rec.get("config_id"),
        "status": rec.get("status"),
        "est_total_bytes": est.total_bytes,
        "est_device_total_bytes": row.predicted_bytes,
        "traced_allocated_bytes": rec.get("peak_allocated_bytes"),
        "replayed_reserved_bytes": rec.get("sim_peak_reserved_bytes"),
        "capacity_bytes": rec.get("sim_capacity_bytes"),
        "capacity_verdict": rec.get("sim_capacity_verdict"),
        "num_alloc_retries": rec.get("sim_num_alloc_retries"),
        "error": rec.get("error"),
    }


def _verified_table(verified) -> str:
    from harness.cli.render.common import human

    def card(rec: dict) -> str:
        v, n = rec.get("sim_capacity_verdict"), rec.get("sim_num_alloc_retries") or 0
        words = {"fits_after_flush": f"fits after {n} flush(es)", "oom_fragmentation": "OOM (fragmentation)"}
        return words.get(v, {"oom_allocated": "OOM"}.get(v, v or rec.get("status", "?")))

    lines = [
        "verified (plan.verify): each layout traced (run.mode=fake), its trace replayed against the card;",
        "ranked by what the card does with it, then by the plan's rank",
        f"  {'#':>2} {'plan':>5}  {'dp':>3} {'tp':>3} {'pp':>3} {'cp':>3} {'zero':>4} {'mbs':>4} "
        f"{'recomp':>9}  {'est alloc':>11} {'est device':>11}  {'traced':>11} {'replayed':>11}  on the card",
    ]
    for i, (rank, row, rec) in enumerate(verified, 1):
        s = row.estimate.spec
        p, t = s.parallel, s.train
        traced, replayed = rec.get("peak_allocated_bytes"), rec.get("sim_peak_reserved_bytes")
        lines.append(
            f"  {i:>2} {rank:>5}  {p.dp:>3} {p.tp:>3} {p.pp:>3} {p.cp:>3} {p.zero_stage:>4} "
            f"{t.micro_batch_size:>4} {t.recompute:>9}  {human(row.estimate.total_bytes):>11} "
            f"{human(row.predicted_bytes):>11}  {human(traced) if traced is not None else '-':>11} "
            f"{human(replayed) if replayed is not None else '-':>11}  {card(rec)}"
        )
    lines.append(
        "est device: the plan's verdict level (reserved + CUDA context and NCCL); traced: the allocated peak "
        "of the worst traced rank; replayed: its trace through the caching-allocator model, unbounded"
    )
    return "\n".join(lines)
