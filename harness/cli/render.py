"""Readable tables and JSON for the commands' output (GiB = 2^30 bytes, MiB = 2^20, only here)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from harness.estimate.core import STATE_TERMS, TERMS, Estimate
from harness.estimate.plan import PlanOptions, PlanResult, PlanRow
from harness.specs import RunSpec, config_id

GIB = 2**30
MIB = 2**20
MAX_STAGE_COLUMNS = 6

# What each row of the estimate table holds (explain=true prints it under the table).
TERM_MEANINGS = {
    "params": "the rank's weights as stored (its shard under ZeRO-3/FSDP, its tp/pp slice)",
    "grads": "gradients alive at the forward/backward peak",
    "optimizer": "AdamW state (two moments, and FP32 master weights where the engine keeps them)",
    "activations": "what the layers save for backward, for every micro-batch in flight",
    "token_ids": "the input token ids of the micro-batches in flight (stage 0)",
    "output_activations": "the final norm's output (last stage)",
    "logits": "the LM head's output (last stage)",
    "param_copies": "compute-dtype (BF16) copies of the weights kept from forward to backward",
    "fsdp_allgather": "ZeRO-3: unsharded layers gathered for the current and the prefetched layer",
    "grad_reduce": "ZeRO-2/3: one layer's unsharded gradients before their reduce-scatter",
    "tp_allgather": "sequence parallel: the full-sequence buffer at a layer boundary",
    "pp_p2p": "pipeline send/receive buffers of a stage-boundary activation",
    "cp_kv_allgather": "context parallel: one layer's gathered K and V",
    "loss": "the cross-entropy's FP32 logits and their gradient (last stage)",
    "step_grads": "gradients made after the peak, alive during the optimizer step instead",
    "optimizer_step": "the foreach AdamW step's temporaries",
}
# format=json's units, said in the JSON itself (the table prints utilisation as a percentage).
JSON_UNITS = {
    "*_bytes": "bytes",
    "utilisation": "ratio of the predicted peak to capacity_bytes (0.8 = 80 %); in plan, of the device level",
    "threshold": "ratio (0.8 = 80 %)",
}
PLAN_LEGEND = (
    "mbs micro-batch size; m micro-batches per step; sched 1f1b, gpipe or int1f1b/v (interleaved 1F1B, "
    "v virtual stages); memory the predicted peak of the most-loaded rank; util that peak / capacity; "
    "bubble pipeline idle time / useful time; comm bytes each device sends per step; step s the "
    "ranking proxy"
)


def human(n_bytes: float) -> str:
    """Bytes for people: GiB (2^30) from 1 GiB up, MiB (2^20) below, KiB under 1 MiB."""
    if abs(n_bytes) >= GIB:
        return f"{n_bytes / GIB:.2f} GiB"
    if abs(n_bytes) >= MIB:
        return f"{n_bytes / MIB:.1f} MiB"
    if n_bytes == 0:
        return "0"
    return f"{n_bytes / 1024:.1f} KiB"


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


def _legend(text: str, width: int = 110) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def human_bytes_in(text: str) -> str:
    """A message with byte counts (``peak 35806396 B``) in human units (``peak 34.1 MiB``)."""
    return re.sub(r"\b(\d{4,}) ?B\b", lambda m: human(int(m.group(1))), text)


def layout_line(spec: RunSpec) -> str:
    p = spec.parallel
    parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}", f"cp={p.cp}", f"zero={p.zero_stage}"]
    if p.tp > 1:
        parts.append(f"sp={'on' if p.sequence_parallel else 'off'}")
    if p.pp > 1:
        parts.append(p.pp_schedule + (f"(v={p.virtual_stages})" if p.virtual_stages > 1 else ""))
    if p.cp > 1:
        parts.append(f"cp_balance={'on' if p.cp_load_balance else 'off'}")
    return " ".join(parts) + f"  (world {p.world})"


def recompute_label(recompute: str, every: Any = 1, method: Any = "every") -> str:
    """``full``, ``full/2`` (every 2nd block), ``full/uniform2`` or ``full/block2`` (Megatron's
    ``--recompute-method`` with ``--recompute-num-layers 2``): the recomputation as tables print it."""
    if recompute != "full" or every is None or every != every:
        return str(recompute)
    if method in ("uniform", "block"):
        return f"full/{method}{int(every)}"
    return f"full/{int(every)}" if int(every) > 1 else "full"


def train_line(spec: RunSpec) -> str:
    t = spec.train
    rc = recompute_label(t.recompute, t.recompute_every, t.recompute_method)
    return (
        f"seq {t.seq_len} × micro-batch {t.micro_batch_size} × {t.num_microbatches} micro-batches "
        f"(global batch {spec.global_batch_size}), recompute {rc}, {t.precision}, "
        f"{t.attention} attention"
    )


def _stage_columns(est: Estimate) -> list[int]:
    """Indexes into est.stages to print: all, or the first two, the worst and the last."""
    n = len(est.stages)
    if n <= MAX_STAGE_COLUMNS:
        return list(range(n))
    worst = est.stages.index(est.worst)
    return sorted({0, 1, worst, n - 1})


def estimate_table(
    est: Estimate,
    *,
    threshold: float,
    calibrated_bytes: int | None = None,
    profile=None,
    explain: bool = False,
) -> str:
    spec = est.spec
    cols = _stage_columns(est)
    head = [f"stage {est.stages[i].stage}" for i in cols]
    lines = [
        f"{spec.model.name} on {spec.device.name}, engine {est.engine}   config_id {config_id(spec)}",
        f"layout  {layout_line(spec)}",
        f"train   {train_line(spec)}",
        "",
        f"{'per rank':<22}" + "".join(f"{h:>12}" for h in head),
    ]
    for term in TERMS:
        values = [est.stages[i].terms[term] for i in cols]
        if not any(s.terms[term] for s in est.stages):
            continue  # zero on every stage: leave the row out
        lines.append(f"{term:<22}" + "".join(f"{human(v):>12}" for v in values))
        if term == STATE_TERMS[-1]:
            lines.append(f"{'':<22}" + "".join(f"{'-' * 9:>12}" for _ in cols))
    lines.append(
        f"{'peak (see below)':<22}" + "".join(f"{human(est.stages[i].total_bytes):>12}" for i in cols)
    )
    if len(cols) < len(est.stages):
        lines.append(f"({len(est.stages)} stages; format=json lists every one)")
    util = est.device_utilisation
    verdict = "fits" if util <= threshold else "does NOT fit"
    reserved = est.reserved_terms()
    lines += [
        "",
        "peak = params + grads + optimizer + max(activations and buffers, optimizer step)",
        f"most-loaded rank: stage {est.worst.stage}, {human(est.total_bytes)} of "
        f"{human(est.capacity_bytes)} = {est.utilisation:.1%} allocated (the tensors)",
        f"reserved by the caching allocator: {human(est.reserved_total_bytes)} (segment rounding "
        f"{human(reserved['segment_rounding'])}, cuBLAS workspace {human(reserved['cublas_workspace'])}; "
        "fragmentation: calibration=PROFILE)",
        f"device level (what runs out): {human(est.device_total_bytes)} = {util:.1%} utilisation"
        + ("" if calibrated_bytes is not None else f" → {verdict} (threshold {threshold:.0%})")
        + f" (CUDA context {human(est.outside_terms['cuda_context'])}, NCCL "
        f"{human(est.outside_terms['nccl'])})",
    ]
    if calibrated_bytes is not None:
        from harness.estimate.levels import verdict_bytes

        device = verdict_bytes(est, profile)
        cal_util = device / est.capacity_bytes
        cal_verdict = "fits" if cal_util <= threshold else "does NOT fit"
        reserved = profile.reserved_bytes(est)
        lines += [
            f"calibrated ({profile.path}): allocated {human(calibrated_bytes)}"
            + (f", reserved {human(reserved)} (fitted fragmentation)" if reserved is not None else "")
            + f", device level {human(device)} = {cal_util:.1%} → {cal_verdict} (threshold {threshold:.0%})",
            f"  profile: {profile.summary}",
        ]
    lines += [
        f"model FLOPs per step: {est.flops_per_step:.3e} ({est.flops_convention} convention)",
    ]
    lines += [f"note: {n}" for n in est.notes]
    if explain:
        shown = [t for t in TERMS if any(st.terms[t] for st in est.stages)]
        lines += ["", "rows:"] + [f"  {t:<20} {TERM_MEANINGS[t]}" for t in shown]
        lines += [
            "  utilisation          predicted peak / device capacity; a percentage here, a ratio in "
            "format=json (0.483 = 48.3 %)",
            "  GiB = 2^30 bytes, MiB = 2^20 bytes",
        ]
    else:
        lines.append("(explain=true: what each row means)")
    return "\n".join(lines)


def _row_fields(row: PlanRow) -> dict[str, Any]:
    spec, c = row.estimate.spec, row.cost
    p, t = spec.parallel, spec.train
    return {
        "config_id": config_id(spec),
        "parallel_dp": p.dp,
        "parallel_tp": p.tp,
        "parallel_pp": p.pp,
        "parallel_cp": p.cp,
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
        "utilisation": row.utilisation,
        "fits": row.fits,
        "bubble": c.bubble,
        "comm_bytes": round(c.comm_bytes),
        "step_time_proxy_s": None if math.isnan(c.step_time_s) else c.step_time_s,
        "predicted_step_time_s": row.predicted_step_time_s,
        "predicted_tflops_per_device": row.predicted_tflops_per_device,
    }


def plan_json(result: PlanResult, opts: PlanOptions) -> dict[str, Any]:
    return {
        "gpus": opts.gpus,
        "engine": opts.engine,
        "threshold": opts.threshold,
        "considered": result.considered,
        "invalid": result.invalid,
        "valid": len(result.rows),
        "fitting": len(result.fitting),
        "layouts": [_row_fields(r) for r in result.fitting],
        "units": JSON_UNITS,
    }


def plan_table(result: PlanResult, opts: PlanOptions, *, top: int, explain: bool = False) -> str:
    first = result.rows[0].estimate.spec if result.rows else None
    lines = []
    if first is not None:
        t = first.train
        lines.append(
            f"{first.model.name} on {opts.gpus} × {first.device.name}, engine {opts.engine}, "
            f"seq {t.seq_len}, "
            f"global batch {first.global_batch_size}, {t.precision}"
        )
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
                f"({best.utilisation:.0%} utilisation): {layout_line(best.estimate.spec)}"
            )
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
    header = (
        f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>4} {'zero':>4} {'sched':>10} {'mbs':>4} {'m':>5} "
    )
    header += f"{'recomp':>13} {'memory':>10} {'util':>6} {'bubble':>7} {'comm':>10}"
    header += f" {'step s':>8}" if has_time else ""
    header += f" {'TFLOP/s':>8}" if fitted else ""
    lines.append(header)
    for i, row in enumerate(result.fitting[:top], 1):
        spec, c = row.estimate.spec, row.cost
        p, t = spec.parallel, spec.train
        sched = (
            "-" if p.pp == 1 else (p.pp_schedule.replace("interleaved_1f1b", f"int1f1b/{p.virtual_stages}"))
        )
        line = (
            f"{i:>3} {p.dp:>5} {p.tp:>3} {p.pp:>3} {p.cp:>4} {p.zero_stage:>4} {sched:>10} "
            f"{t.micro_batch_size:>4} {t.num_microbatches:>5} "
            f"{recompute_label(t.recompute, t.recompute_every, t.recompute_method):>13} "
            f"{human(row.predicted_bytes):>10} {row.utilisation:>6.1%} {c.bubble:>7.1%} "
            f"{human(c.comm_bytes):>10}"
        )
        if fitted:
            tflops = row.predicted_tflops_per_device
            line += f" {row.predicted_step_time_s:>8.3f} {'-' if tflops is None else f'{tflops:.3g}':>8}"
        elif has_time:
            line += f" {c.step_time_s:>8.3f}"
        lines.append(line)
    short = PLAN_LEGEND.split("; memory")[0] + "; explain=true: every column"
    lines += ["", *_legend(PLAN_LEGEND if explain else short)]
    return "\n".join(lines)


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
        why = {
            "min_gpus": f"no layout fits on any of {tried} devices (plan.max_gpus to try more)",
            "max_micro_batch": f"not even micro-batch 1 fits: {_verdict(solution.over)}",
            "max_seq_len": f"not even {solution.tried[0]} tokens fit: {_verdict(solution.over)}"
            if solution.over
            else "",
        }[q]
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
    out["units"] = JSON_UNITS
    return out


def _solve_row(row: PlanRow) -> dict[str, Any]:
    fields = _row_fields(row) if row.cost is not None else {}
    spec = row.estimate.spec
    fields.update(
        config_id=config_id(spec),
        world_size=spec.parallel.world,
        train_micro_batch_size=spec.train.micro_batch_size,
        train_seq_len=spec.train.seq_len,
        total_bytes=row.estimate.total_bytes,
        calibrated_bytes=row.calibrated_bytes,
        device_total_bytes=row.predicted_bytes,
        utilisation=row.utilisation,
        fits=row.fits,
    )
    return fields


def _clean(value: Any) -> Any:
    """JSON has no NaN: a missing measurement is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def record_json(record: dict[str, Any]) -> str:
    import json

    return json.dumps({k: _clean(v) for k, v in record.items()}, indent=2)


def _timing(r: dict[str, Any]) -> str:
    """How the step time was measured: ``median of 3 steps on rank 1, spread 4.2 %``."""
    times, spread = r.get("step_times_s"), r.get("step_time_spread")
    if not times:  # a record from before step_times_s
        return "median of measured steps, slowest rank"
    rank = r.get("step_time_rank")
    text = f"median of {len(times)} step{'s' if len(times) > 1 else ''} on rank {rank}, the slowest"
    if spread is not None and not math.isnan(spread):
        text += f"; spread (max - min) / median {spread:.1%}"
    return text


def record_table(record: dict[str, Any]) -> str:
    r = record
    rc = recompute_label(
        r["train_recompute"], r.get("train_recompute_every"), r.get("train_recompute_method")
    )
    lines = [
        f"{r['model_name']} on {r['device_name']}, config_id {r['config_id']}: status {r['status'].upper()}",
        f"layout  dp={r['parallel_dp']} tp={r['parallel_tp']} pp={r['parallel_pp']} cp={r['parallel_cp']} "
        f"zero={r['parallel_zero_stage']}  seq {r['train_seq_len']} × micro-batch "
        f"{r['train_micro_batch_size']} × {r['train_num_microbatches']}, recompute {rc}, "
        f"{r['train_precision']}",
    ]
    if r.get("error"):
        where = f" (rank {r['error_rank']})" if r.get("error_rank") is not None else ""
        lines.append(f"error{where}: {human_bytes_in(str(r['error']))}")
    if r.get("peak_allocated_bytes") is not None:
        peaks = ", ".join("—" if p is None else human(p) for p in r["per_rank_peak_bytes"])
        lines += [
            "",
            f"peak memory ({r['memory_method']}): max {human(r['peak_allocated_bytes'])} on rank "
            f"{r['worst_rank']}; per rank: {peaks}",
        ]
        cats = {k[4:-6]: v for k, v in r.items() if k.startswith("mem_") and k.endswith("_bytes") and v}
        if cats:
            lines.append("  worst rank by category: " + ", ".join(f"{k} {human(v)}" for k, v in cats.items()))
        if r.get("peak_reserved_bytes") is not None:
            lines.append(
                f"  reserved {human(r['peak_reserved_bytes'])}, device used {human(r['device_used_bytes'])}"
            )
        if r.get("est_total_bytes") is not None:
            ratio = r["peak_allocated_bytes"] / r["est_total_bytes"]
            lines.append(
                f"  estimate (engine torch): {human(r['est_total_bytes'])} → measured/estimate {ratio:.2f}"
            )
        mfu = r.get("mfu")
        if r.get("fake_traced_ranks") is not None:  # run.mode=fake: memory only, no step was timed
            lines.append(f"  fake run: traced ranks {r['fake_traced_ranks']}, kernels {r['fake_kernels']}")
        else:
            lines += [
                f"step time {r['step_time_s']:.3f} s ({_timing(r)}), "
                f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_device']:.4f} TFLOP/s per device, "
                f"MFU {'n/a' if mfu is None or math.isnan(mfu) else f'{mfu:.1%}'} "
                f"(reference {r['mfu_reference_tflops']:.3g} TFLOP/s)",
                f"loss by step: {', '.join(f'{x:.4f}' for x in r['losses'])}",
            ]
    tasks = r.get("launch_tasks") or 1
    spread = f"; {tasks} tasks on {', '.join(r.get('launch_hosts') or [])}" if tasks > 1 else ""
    lines.append(
        f"wall {r.get('wall_s', 0):.1f} s; torch {r.get('env_torch_version')}; "
        f"git {r.get('env_git_revision')}{spread}"
    )
    return "\n".join(lines)


def calibration_table(ev, *, profile_path: str) -> str:
    """``harness calibrate``'s table: every estimator's held-out accuracy, then the fitted profile."""
    n = ev.data.measured.sum()
    lines = [
        f"{len(ev.data.frame)} runs (ok or oom), {n} with a measured peak; engine {ev.engine}; "
        f"calibrated errors are held out by {ev.group_by} ({len(ev.fold_coefs)} folds)",
        "",
        f"{'estimator':<11} {'median APE':>10} {'p95 APE':>8} {'worst under':>11} {'safe thr.':>9} "
        f"{'excl.':>6} {'OOM<80%':>8} {'excl.>80%':>10}",
    ]
    for name, m in ev.metrics.items():
        safe = "none" if m["safe_threshold"] is None else f"{m['safe_threshold']:.1%}"
        lines.append(
            f"{name:<11} {m['median_ape']:>10.1%} {m['p95_ape']:>8.1%} {m['max_under_prediction']:>11.1%} "
            f"{safe:>9} {m['excluded_at_safe']:>6} {m['oom_below_paper_threshold']:>8} "
            f"{m['excluded_at_paper_threshold']:>10}"
        )
    lines += [
        "",
        "APE: |predicted - measured| / measured; worst under: the largest under-prediction; safe thr.: the",
        "largest estimated utilisation below which no run ran out of memory (none: no run did); excl.: runs",
        "that ran (ok) but sit above it, so the threshold would have excluded them; OOM<80%: runs out of",
        "memory that the paper's 80 % rule calls safe; excl.>80%: ok runs that the 80 % rule excludes.",
        f"profile ({profile_path}): {ev.model.describe()}",
    ]
    f = ev.fragmentation
    if f is None:
        lines.append("fragmentation: not fitted (no run reports a reserved peak, measured or replayed)")
    else:
        h = f["held_out"]
        safe = "none" if h["safe_threshold"] is None else f"{h['safe_threshold']:.1%}"
        lines += [
            f"fragmentation (reserved - allocated, fitted on {f['fitted_runs']} runs' {f['target']}): "
            f"{f['summary']}",
            f"  held out at the reserved level: median APE {h['median_ape']:.1%}, p95 {h['p95_ape']:.1%}, "
            f"worst under {h['max_under_prediction']:.1%}, safe threshold {safe}",
        ]
    return "\n".join(lines)


def step_time_table(st) -> str:
    """``harness calibrate``'s step-time part: held-out accuracy, ranking per group, the fitted terms."""
    m = st.metrics

    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [
        f"step time: {m['fit_runs']} timed runs fitted, {m['judged_runs']} that fit judged, held out by "
        f"{st.group_by} ({len(st.fold_coefs)} folds): median APE {fmt(m['median_ape'], '.1%')}, "
        f"Spearman median {fmt(m['spearman_median'], '.2f')}, "
        f"top-1 ratio median {fmt(m['top1_ratio_median'], '.1%')}",
        f"{'model':<10} {'world':>5} {'runs':>5} {'Spearman':>9} {'top-1':>7}",
    ]
    for g in m["groups"]:
        lines.append(
            f"{g['model']:<10} {g['world']:>5} {g['runs']:>5} {g['spearman']:>9.2f} {g['top1_ratio']:>7.1%}"
        )
    lines += [
        "Spearman: rank correlation of predicted and measured tokens/s within the group; top-1: measured",
        "tokens/s of the layout predicted fastest over the best measured.",
        f"step-time profile ({st.model.device}): " + "; ".join(st.model.describe()),
    ]
    return "\n".join(lines)
