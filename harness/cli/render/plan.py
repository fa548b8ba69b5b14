"""``harness plan``'s tables and JSON: the ranked layouts, and the reverse questions' answers (plan.solve)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from harness.cli.render.common import _legend, human, layout_line, recompute_label, train_line
from harness.estimate.plan import PlanOptions, PlanResult, PlanRow
from harness.spec import canonical_config_id, canonical_form

PLAN_LEGEND = (
    "mbs micro-batch size; m micro-batches per step; sched 1f1b, gpipe or int1f1b/v (interleaved 1F1B, "
    "v virtual stages); memory the predicted peak of the most-loaded rank; util that peak / capacity; "
    "bubble pipeline idle time / useful time; comm bytes each device sends per step; step s≥ the "
    "ranking proxy, a lower bound on the step time (every FLOP at the device's peak, plus the bubble and "
    "the communication it cannot hide); MFU≤ the model FLOP utilisation that step time would mean, an "
    "upper bound (issue 31: the proxy's seconds read as 85 % MFU on a 70B model); with a fitted step "
    "time (calibration=) step s and TFLOP/s are its predictions"
)


UNEVEN_LEGEND = (
    "pp* uneven stages (the layers do not divide by pp): one block fewer on the first and the last "
    "stage, then the second and the second to last, ... (parallel.pp_layers; plan.include or estimate "
    "with the layout prints them)"
)


def pp_cell(p) -> str:
    """The pp column: ``32*`` where the stages are uneven (``parallel.pp_layers``)."""
    return f"{p.pp}*" if p.pp_layers else str(p.pp)


def _row_fields(row: PlanRow) -> dict[str, Any]:
    """A layout's JSON fields: its spec, the levels and verdict, and for a fitting layout its cost."""
    spec = row.estimate.spec
    p, t = spec.parallel, spec.train
    out = {
        # (every row was estimated, so valid: its id without validating it again)
        "config_id": canonical_config_id(canonical_form(spec)),
        "parallel_dp": p.dp,
        "parallel_tp": p.tp,
        "parallel_pp": p.pp,
        "parallel_pp_layers": list(p.pp_layers),
        "parallel_cp": p.cp,
        "parallel_ep": p.ep,
        "parallel_zero_stage": p.zero_stage,
        "parallel_sequence_parallel": p.sequence_parallel,
        "parallel_pp_schedule": p.pp_schedule,
        "parallel_virtual_stages": p.virtual_stages,
        "train_micro_batch_size": t.micro_batch_size,
        "train_num_microbatches": t.num_microbatches,
        "train_recompute": t.recompute,
        "train_recompute_every": t.recompute_every,
        "train_recompute_method": t.recompute_method,
        "total_bytes": row.estimate.total_bytes,
        "calibrated_bytes": row.calibrated_bytes,
        "device_total_bytes": row.predicted_bytes,
        "worst_stage": row.estimate.worst.stage,
        "utilisation": row.utilisation,  # the level the verdict is on (device, calibrated with a profile)
        **_level_shares(row),
        "fits": row.fits,
    }
    c = row.cost
    if c is not None:  # (computed for fitting layouts only)
        out.update(
            bubble=c.bubble,
            comm_bytes=round(c.comm_bytes),
            step_time_proxy_s=None if math.isnan(c.step_time_s) else c.step_time_s,
            predicted_step_time_s=row.predicted_step_time_s,
            predicted_tflops_per_device=row.predicted_tflops_per_device,
        )
    return out


def _level_shares(row: PlanRow) -> dict[str, float]:
    """The three levels' shares of the card under the names estimate uses (issue 31 item 6); the device
    level is the one the verdict is on (``predicted_bytes``: calibrated where plan uses a profile)."""
    est = row.estimate
    return {
        "allocated_utilisation": (row.calibrated_bytes or est.total_bytes) / est.capacity_bytes,
        "reserved_utilisation": (row.predicted_bytes - est.outside_allocator_bytes) / est.capacity_bytes,
        "device_utilisation": row.utilisation,
    }


def plan_json(result: PlanResult, opts: PlanOptions) -> dict[str, Any]:
    return {
        "gpus": opts.gpus,
        "engine": opts.engine,
        "threshold": opts.threshold,
        "given": list(opts.given),
        "considered": result.considered,
        "invalid": result.invalid,
        "valid": len(result.rows),
        "fitting": len(result.fitting),
        "layouts": [_row_fields(r) for r in result.fitting],
    }


def _layers(p) -> str:
    """``(layers 31+32+32+31)`` after pp where the stages are uneven."""
    return f" (layers {'+'.join(map(str, p.pp_layers))})" if p.pp_layers else ""


def include_lines(row: PlanRow, rank: int | None, result: PlanResult, opts: PlanOptions) -> list[str]:
    """``plan.include``: where the user's own layout ranks among the fitting ones, or the term that
    breaks the budget."""
    p, t = row.estimate.spec.parallel, row.estimate.spec.train
    sched = "-" if p.pp == 1 else p.pp_schedule.replace("interleaved_1f1b", f"int1f1b/{p.virtual_stages}")
    rc = recompute_label(t.recompute, t.recompute_every, t.recompute_method)
    what = (
        f"dp={p.dp} tp={p.tp} pp={p.pp}{_layers(p)} cp={p.cp}{f' ep={p.ep}' if p.ep > 1 else ''} "
        f"zero={p.zero_stage} sched={sched} "
        f"mbs={t.micro_batch_size} m={t.num_microbatches} recompute={rc}"
    )
    level = f"{human(row.predicted_bytes)} = {row.utilisation:.1%} of the device"
    if rank is None:
        return [
            f"your layout (plan.include): {what}",
            f"  does NOT fit: {level} (threshold {opts.threshold:.0%}); over at "
            f"{breaking_term(row, opts.threshold)}",
        ]
    step = row.predicted_step_time_s if row.predicted_step_time_s is not None else row.cost.step_time_s
    timing = "" if step is None or math.isnan(step) else f", step s≥ {step:.3f}"
    return [
        f"your layout (plan.include): {what}",
        f"  ranks {rank} of {len(result.fitting)} fitting: {level}{timing}",
    ]


def include_json(row: PlanRow, rank: int | None) -> dict[str, Any]:
    """``plan.include``'s JSON: the layout's fields and its rank among the fitting (None: it does not fit)."""
    return {**_row_fields(row), "rank": rank}


def breaking_term(row: PlanRow, threshold: float) -> str:
    """The first term of the most-loaded rank (states, then activations and buffers, in the estimator's
    order) at which the running sum, with the memory outside the allocator, passes ``threshold`` of the
    card (issue 31: what to change first in a layout that does not fit)."""
    from harness.estimate.terms import ACTIVATION_TERMS, BUFFER_TERMS, STATE_TERMS

    est = row.estimate
    budget = threshold * est.capacity_bytes - est.outside_allocator_bytes
    total = 0
    for term in (*STATE_TERMS, *ACTIVATION_TERMS, *BUFFER_TERMS):
        total += est.worst.terms.get(term, 0)
        if total > budget:
            return term
    return "reserve"  # over only with the allocator's reserve (or a profile's correction)


def _over_rows(result: PlanResult, opts: PlanOptions, top: int) -> list[str]:
    """``plan.show=all``: the valid layouts that do not fit, the smallest first, with the term that
    breaks the budget."""
    over = sorted((r for r in result.rows if not r.fits), key=lambda r: r.predicted_bytes)
    lines = [
        f"do not fit ({len(over)}), the smallest {min(top, len(over))}, with the term that breaks "
        "the budget:",
        f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>4} {'zero':>4} {'mbs':>4} {'m':>5} {'recomp':>13} "
        f"{'memory':>10} {'util':>6}",
    ]
    for i, row in enumerate(over[:top], 1):
        p, t = row.estimate.spec.parallel, row.estimate.spec.train
        rc = recompute_label(t.recompute, t.recompute_every, t.recompute_method)
        lines.append(
            f"{i:>3} {p.dp:>5} {p.tp:>3} {pp_cell(p):>3} {p.cp:>4} {p.zero_stage:>4} {t.micro_batch_size:>4} "
            f"{t.num_microbatches:>5} {rc:>13} {human(row.predicted_bytes):>10} {row.utilisation:>6.1%}  "
            f"over at {breaking_term(row, opts.threshold)}"
        )
    return lines


def plan_table(
    result: PlanResult, opts: PlanOptions, *, top: int, explain: bool = False, show_all: bool = False
) -> str:
    first = result.rows[0].estimate.spec if result.rows else None
    lines = []
    if first is not None:
        t = first.train
        lines.append(
            f"{first.model.name} on {opts.gpus} × {first.device.name}, engine {opts.engine}, "
            f"seq {t.seq_len}, "
            f"global batch {first.global_batch_size}, {t.precision}"
        )
    if opts.given:
        lines.append(f"given: {' '.join(opts.given)}: only layouts with these are considered")
    lines.append(
        f"{result.considered} layouts considered, {result.invalid} impossible, {len(result.rows)} valid, "
        f"{len(result.fitting)} fit under {opts.threshold:.0%} of device memory"
        + (f" (calibrated: {opts.calibration.path})" if opts.calibration is not None else "")
    )
    if not result.fitting:
        if result.rows:
            best = min(result.rows, key=lambda r: r.predicted_bytes)
            lines.append(
                f"nothing fits; the smallest needs {human(best.predicted_bytes)} "
                f"({best.utilisation:.0%} utilisation, over at {breaking_term(best, opts.threshold)}): "
                f"{layout_line(best.estimate.spec)}"
            )
            if show_all:
                lines += ["", *_over_rows(result, opts, top)]
        return "\n".join(lines)
    fitted = result.fitting[0].predicted_step_time_s is not None
    has_time = fitted or not math.isnan(result.fitting[0].cost.step_time_s)
    rank_by = (
        "the fitted step time (calibration's step_time section)"
        if fitted
        else "step-time proxy (compute at peak + bubble + unoverlapped comm)"
        if has_time
        else (
            "compute overhead (recomputation × bubble), then communication volume (no peak/link figures for "
            "this device)"
        )
    )
    lines += [f"ranked by {rank_by}; top {min(top, len(result.fitting))}:"]
    timer = opts.step_time
    if fitted and timer.precisions and first.train.precision not in timer.precisions:
        lines.append(
            f"note: the step-time profile was fitted on {', '.join(timer.precisions)} runs, this plan is "
            f"{first.train.precision}: its compute efficiency is carried over unchecked"
        )
    if fitted and timer.unfitted:
        lines.append(
            f"note: the step-time profile had no run with {', '.join(timer.unfitted)}: layouts that need "
            "them are ranked without that cost"
        )
    if opts.step_time is not None and not fitted:
        lines.append(
            f"note: the step-time profile was fitted on device {timer.device}, not {first.device.name}: "
            "ranked by the proxy instead"
        )
    lines.append("")
    moe = bool(first.model.num_experts)  # an ep column for a mixture of experts only
    header = f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>4} " + (f"{'ep':>4} " if moe else "")
    header += f"{'zero':>4} {'sched':>10} {'mbs':>4} {'m':>5} "
    header += f"{'recomp':>13} {'memory':>10} {'util':>6} {'bubble':>7} {'comm':>10}"
    header += (f" {'step s':>8}" if fitted else f" {'step s≥':>8} {'MFU≤':>6}") if has_time else ""
    header += f" {'TFLOP/s':>8}" if fitted else ""
    lines.append(header)
    for i, row in enumerate(result.fitting[:top], 1):
        spec, c = row.estimate.spec, row.cost
        p, t = spec.parallel, spec.train
        sched = (
            "-" if p.pp == 1 else (p.pp_schedule.replace("interleaved_1f1b", f"int1f1b/{p.virtual_stages}"))
        )
        line = (
            f"{i:>3} {p.dp:>5} {p.tp:>3} {pp_cell(p):>3} {p.cp:>4} "
            + (f"{p.ep:>4} " if moe else "")
            + f"{p.zero_stage:>4} {sched:>10} "
            f"{t.micro_batch_size:>4} {t.num_microbatches:>5} "
            f"{recompute_label(t.recompute, t.recompute_every, t.recompute_method):>13} "
            f"{human(row.predicted_bytes):>10} {row.utilisation:>6.1%} {c.bubble:>7.1%} "
            f"{human(c.comm_bytes):>10}"
        )
        if fitted:
            tflops = row.predicted_tflops_per_device
            line += f" {row.predicted_step_time_s:>8.3f} {'-' if tflops is None else f'{tflops:.3g}':>8}"
        elif has_time:
            line += f" {c.step_time_s:>8.3f} {_implied_mfu(row):>6}"
        lines.append(line)
    if show_all:
        lines += ["", *_over_rows(result, opts, top)]
    short = PLAN_LEGEND.split("; memory")[0] + "; explain=true: every column"
    lines += ["", *_legend(PLAN_LEGEND if explain else short)]
    if any(r.estimate.spec.parallel.pp_layers for r in result.fitting[:top]):
        lines += _legend(UNEVEN_LEGEND)
    return "\n".join(lines)


def _implied_mfu(row: PlanRow) -> str:
    """The model FLOP utilisation a step of the proxy's seconds would mean (an upper bound: the proxy is
    a lower bound on the step time)."""
    est, step = row.estimate, row.cost.step_time_s
    peak = est.spec.device.peak_tflops
    if not peak or not step or math.isnan(step):
        return "-"
    return f"{est.flops_per_step / (step * est.spec.parallel.world * peak * 1e12):.0%}"


SOLVE_WHAT = {
    "min_gpus": "fewest devices on which a layout fits",
    "max_micro_batch": "largest micro-batch that fits",
    "max_seq_len": "longest sequence that fits",
}


def _verdict(row: PlanRow) -> str:
    return f"{human(row.predicted_bytes)} = {row.utilisation:.2%} utilisation"


def solve_table(solution, opts: PlanOptions, *, top: int, explain: bool = False) -> str:
    """``plan plan.solve=...``: the answer, the estimate at it and at the first value past it."""
    q = solution.question
    shown = solution.best or solution.over
    lines = []
    if shown is not None:
        spec = shown.estimate.spec
        lines.append(
            f"{spec.model.name} on {spec.device.name}, engine {opts.engine}, threshold {opts.threshold:.0%}"
            + (f" (calibrated: {opts.calibration.path})" if opts.calibration is not None else "")
        )
        if q != "min_gpus":
            lines += [f"layout  {layout_line(spec)}", f"train   {train_line(spec)}"]
    tried = ", ".join(map(str, solution.tried))
    if solution.answer is None:
        # (each reason built only for its own question: the others' rows may not exist)
        if q == "min_gpus":
            why = f"no layout fits on any of {tried} devices (plan.max_gpus to try more)"
        elif solution.over is None:
            why = f"nothing was estimated (tried {tried or 'nothing'})"
        elif q == "max_micro_batch":
            why = f"not even micro-batch 1 fits: {_verdict(solution.over)}"
        else:
            why = f"not even {solution.tried[0]} tokens fit: {_verdict(solution.over)}"
        lines.append(f"{SOLVE_WHAT[q]}: none; {why}")
        return "\n".join(lines)
    if q == "min_gpus":
        spec = solution.best.estimate.spec
        per_node = spec.device.gpus_per_node
        nodes = -(-solution.answer // per_node)
        lines += [
            f"{SOLVE_WHAT[q]}: {solution.answer} ({nodes} node{'s' * (nodes > 1)} of {per_node}); "
            f"tried {tried}",
            "",
            plan_table(
                solution.plan, dataclasses.replace(opts, gpus=solution.answer), top=top, explain=explain
            ),
        ]
        return "\n".join(lines)

    def said(v: int) -> str:
        return f"micro-batch {v}" if q == "max_micro_batch" else f"{v} tokens"

    answer = str(solution.answer) if q == "max_micro_batch" else said(solution.answer)
    lines.append(f"{SOLVE_WHAT[q]}: {answer} → {_verdict(solution.best)}")
    if solution.over is not None:
        past = solution.over.estimate.spec.train
        value = past.micro_batch_size if q == "max_micro_batch" else past.seq_len
        lines.append(f"  {said(value)} would need {_verdict(solution.over)}")
    else:
        lines.append("  (the search limit: more may fit)")
    if q == "max_seq_len":
        lines.append(f"  (sequence lengths tried in steps of {solution.tried[0]} tokens: {tried})")
    else:
        lines.append(f"  (tried {tried})")
    return "\n".join(lines)


def solve_json(solution, opts: PlanOptions) -> dict[str, Any]:
    out: dict[str, Any] = {
        "solve": solution.question,
        "answer": solution.answer,
        "engine": opts.engine,
        "threshold": opts.threshold,
        "tried": list(solution.tried),
        "best": None if solution.best is None else _solve_row(solution.best),
        "over": None if solution.over is None else _solve_row(solution.over),
    }
    if solution.plan is not None:
        out["plan"] = plan_json(solution.plan, dataclasses.replace(opts, gpus=solution.answer))
    return out


def _solve_row(row: PlanRow) -> dict[str, Any]:
    spec = row.estimate.spec
    return {**_row_fields(row), "world_size": spec.parallel.world, "train_seq_len": spec.train.seq_len}
