"""Readable tables and JSON for the commands' output (GiB = 2^30 bytes, only here)."""

from __future__ import annotations

import math
from typing import Any

from harness.estimate.core import STATE_TERMS, TERMS, Estimate
from harness.estimate.plan import PlanOptions, PlanResult, PlanRow
from harness.specs import RunSpec, config_id

GIB = 2**30
MAX_STAGE_COLUMNS = 6


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


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


def train_line(spec: RunSpec) -> str:
    t = spec.train
    return (
        f"seq {t.seq_len} × micro-batch {t.micro_batch_size} × {t.num_microbatches} micro-batches "
        f"(global batch {spec.global_batch_size}), recompute {t.recompute}, {t.precision}, "
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
    est: Estimate, *, threshold: float, calibrated_bytes: int | None = None, profile=None
) -> str:
    spec = est.spec
    cols = _stage_columns(est)
    head = [f"stage {est.stages[i].stage}" for i in cols]
    lines = [
        f"{spec.model.name} on {spec.device.name}, engine {est.engine}   config_id {config_id(spec)}",
        f"layout  {layout_line(spec)}",
        f"train   {train_line(spec)}",
        "",
        f"{'GiB per rank':<22}" + "".join(f"{h:>11}" for h in head),
    ]
    for term in TERMS:
        values = [est.stages[i].terms[term] for i in cols]
        if not any(s.terms[term] for s in est.stages):
            continue  # zero on every stage: leave the row out
        lines.append(f"{term:<22}" + "".join(f"{gib(v):>11}" for v in values))
        if term == STATE_TERMS[-1]:
            lines.append(f"{'':<22}" + "".join(f"{'-' * 7:>11}" for _ in cols))
    lines.append(f"{'peak (see below)':<22}" + "".join(f"{gib(est.stages[i].total_bytes):>11}" for i in cols))
    if len(cols) < len(est.stages):
        lines.append(f"({len(est.stages)} stages; format=json lists every one)")
    util = est.utilisation
    verdict = "fits" if util <= threshold else "does NOT fit"
    lines += [
        "",
        "peak = params + grads + optimizer + max(activations and buffers, optimizer step)",
        f"most-loaded rank: stage {est.worst.stage}, {gib(est.total_bytes)} GiB of "
        f"{gib(est.capacity_bytes)} GiB = {util:.1%}"
        + ("" if calibrated_bytes is not None else f" → {verdict} (threshold {threshold:.0%})"),
    ]
    if calibrated_bytes is not None:
        cal_util = calibrated_bytes / est.capacity_bytes
        cal_verdict = "fits" if cal_util <= threshold else "does NOT fit"
        lines += [
            f"calibrated ({profile.path}): {gib(calibrated_bytes)} GiB = {cal_util:.1%} → {cal_verdict} "
            f"(threshold {threshold:.0%})",
            f"  profile: {profile.summary}",
        ]
    lines += [
        f"model FLOPs per step: {est.flops_per_step:.3e} ({est.flops_convention} convention)",
    ]
    lines += [f"note: {n}" for n in est.notes]
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
        "total_bytes": row.estimate.total_bytes,
        "calibrated_bytes": row.calibrated_bytes,
        "worst_stage": row.estimate.worst.stage,
        "utilisation": row.utilisation,
        "fits": row.fits,
        "bubble": c.bubble,
        "comm_bytes": round(c.comm_bytes),
        "step_time_proxy_s": None if math.isnan(c.step_time_s) else c.step_time_s,
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
    }


def plan_table(result: PlanResult, opts: PlanOptions, *, top: int) -> str:
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
                f"nothing fits; the smallest needs {gib(best.predicted_bytes)} GiB "
                f"({best.utilisation:.0%}): {layout_line(best.estimate.spec)}"
            )
        return "\n".join(lines)
    has_time = not math.isnan(result.fitting[0].cost.step_time_s)
    rank_by = (
        "step-time proxy (compute at peak + bubble + unoverlapped comm)"
        if has_time
        else (
            "compute overhead (recomputation × bubble), then communication volume (no peak/link figures for "
            "this device)"
        )
    )
    lines += [f"ranked by {rank_by}; top {min(top, len(result.fitting))}:", ""]
    header = (
        f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>4} {'zero':>4} {'sched':>10} {'mbs':>4} {'m':>5} "
    )
    header += f"{'recomp':>9} {'GiB':>8} {'util':>6} {'bubble':>7} {'comm GiB':>9}"
    header += f" {'step s':>8}" if has_time else ""
    lines.append(header)
    for i, row in enumerate(result.fitting[:top], 1):
        spec, c = row.estimate.spec, row.cost
        p, t = spec.parallel, spec.train
        sched = (
            "-" if p.pp == 1 else (p.pp_schedule.replace("interleaved_1f1b", f"int1f1b/{p.virtual_stages}"))
        )
        line = (
            f"{i:>3} {p.dp:>5} {p.tp:>3} {p.pp:>3} {p.cp:>4} {p.zero_stage:>4} {sched:>10} "
            f"{t.micro_batch_size:>4} {t.num_microbatches:>5} {t.recompute:>9} "
            f"{gib(row.predicted_bytes):>8} {row.utilisation:>6.1%} {c.bubble:>7.1%} "
            f"{c.comm_bytes / GIB:>9.2f}"
        )
        if has_time:
            line += f" {c.step_time_s:>8.3f}"
        lines.append(line)
    return "\n".join(lines)


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


def record_table(record: dict[str, Any]) -> str:
    r = record
    lines = [
        f"{r['model_name']} on {r['device_name']}, config_id {r['config_id']}: status {r['status'].upper()}",
        f"layout  dp={r['parallel_dp']} tp={r['parallel_tp']} pp={r['parallel_pp']} cp={r['parallel_cp']} "
        f"zero={r['parallel_zero_stage']}  seq {r['train_seq_len']} × micro-batch "
        f"{r['train_micro_batch_size']} × {r['train_num_microbatches']}, recompute {r['train_recompute']}, "
        f"{r['train_precision']}",
    ]
    if r.get("error"):
        where = f" (rank {r['error_rank']})" if r.get("error_rank") is not None else ""
        lines.append(f"error{where}: {r['error']}")
    if r.get("peak_allocated_bytes") is not None:
        peaks = ", ".join("—" if p is None else gib(p) for p in r["per_rank_peak_bytes"])
        lines += [
            "",
            f"peak memory (GiB, {r['memory_method']}): max {gib(r['peak_allocated_bytes'])} on rank "
            f"{r['worst_rank']}; per rank: {peaks}",
        ]
        cats = {k[4:-6]: v for k, v in r.items() if k.startswith("mem_") and k.endswith("_bytes") and v}
        if cats:
            lines.append("  worst rank by category: " + ", ".join(f"{k} {gib(v)}" for k, v in cats.items()))
        if r.get("peak_reserved_bytes") is not None:
            lines.append(
                f"  reserved {gib(r['peak_reserved_bytes'])}, device used {gib(r['device_used_bytes'])}"
            )
        if r.get("est_total_bytes") is not None:
            ratio = r["peak_allocated_bytes"] / r["est_total_bytes"]
            lines.append(
                f"  estimate (engine torch): {gib(r['est_total_bytes'])} → measured/estimate {ratio:.2f}"
            )
        mfu = r.get("mfu")
        if r.get("fake_traced_ranks") is not None:  # run.mode=fake: memory only, no step was timed
            lines.append(f"  fake run: traced ranks {r['fake_traced_ranks']}, kernels {r['fake_kernels']}")
        else:
            lines += [
                f"step time {r['step_time_s']:.3f} s (median of measured steps, slowest rank), "
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
        "APE: |predicted - measured| / measured; safe thr.: largest estimated utilisation below which no run",
        "ran out of memory (none: no run did); excl.: runs that fit but sit above it.",
        f"profile ({profile_path}): {ev.model.describe()}",
    ]
    return "\n".join(lines)
