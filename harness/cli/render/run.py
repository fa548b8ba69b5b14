"""``harness run``'s table and JSON: one record, its peaks, timing and environment."""

from __future__ import annotations

import math
from typing import Any

from harness.cli.render.common import human, human_bytes_in, recompute_label


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
