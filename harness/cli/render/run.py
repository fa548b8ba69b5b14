"""``harness run``'s table and JSON: one record, its peaks, timing and environment."""

from __future__ import annotations

import math
from typing import Any

from harness.cli.render.common import capacity_words, human, human_bytes_in, recompute_label, verdict


def _clean(value: Any) -> Any:
    """JSON has no NaN: a missing measurement is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def record_json(record: dict[str, Any]) -> str:
    import json

    from harness.cli.render.common import json_envelope

    return json.dumps(json_envelope({k: _clean(v) for k, v in record.items()}), indent=2)


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


def levels_line(r: dict[str, Any], threshold: float) -> str | None:
    """A GPU preset's three levels with the verdict ``estimate`` gives (issue 31: a fake run of
    Llama-3-8B said "OK, 64.49 GiB" while its replayed reserved peak was 79.19 GiB of a 79.65 GiB
    card): allocated, reserved (measured on CUDA, else replayed from the rank's trace) and the device
    level (measured on CUDA, else reserved plus the estimate's CUDA context and NCCL buffers)."""
    if r.get("device_name") in (None, "cpu") or r.get("peak_allocated_bytes") is None:
        return None
    from harness.estimate import estimate
    from harness.spec import InvalidSpec, from_flat

    try:
        est = estimate(from_flat(r))
    except (InvalidSpec, KeyError, TypeError, ValueError):
        return None
    traced = r.get("memory_method") == "fake"
    if r.get("peak_reserved_bytes") is not None:
        reserved, how = r["peak_reserved_bytes"], "measured"
    elif r.get("sim_peak_reserved_bytes") is not None:
        reserved, how = r["sim_peak_reserved_bytes"], "replayed"
    else:
        reserved, how = None, None
    if r.get("device_used_bytes") is not None:
        device, dhow = r["device_used_bytes"], "measured"
    elif reserved is not None:
        device, dhow = reserved + est.outside_allocator_bytes, "+ CUDA context and NCCL, estimated"
    else:
        return None
    capacity = est.capacity_bytes
    allocated = r["peak_allocated_bytes"] + est.outside_allocator_bytes
    line = (
        f"  levels: allocated {human(r['peak_allocated_bytes'])} ({'traced' if traced else 'measured'}), "
        f"reserved {human(reserved)} ({how}), device {human(device)} ({dhow}) of {human(capacity)} "
        f"= {device / capacity:.1%} → {verdict(device, capacity, threshold, allocated)} "
        f"(threshold {threshold:.0%})"
    )
    if r.get("sim_capacity_verdict") and r.get("sim_capacity_bytes"):
        line += (
            f"\n  on the card: {capacity_words(r['sim_capacity_verdict'], r.get('sim_num_alloc_retries'))} "
            f"(the trace replayed against the {human(r['sim_capacity_bytes'])} the allocator may reserve)"
        )
    return line


def _layers(r: dict[str, Any]) -> str:
    """`` layers=1+3`` for uneven pipeline stages (parallel.pp_layers), else nothing."""
    layers = r.get("parallel_pp_layers")
    return " layers=" + "+".join(map(str, layers)) if layers is not None and len(layers) else ""


def _ep(r: dict[str, Any]) -> str:
    """`` ep=2`` under expert parallelism, else nothing."""
    ep = r.get("parallel_ep")
    return f" ep={ep}" if ep is not None and ep == ep and ep > 1 else ""


def record_table(record: dict[str, Any], *, threshold: float = 0.8) -> str:
    r = record
    rc = recompute_label(
        r["train_recompute"], r.get("train_recompute_every"), r.get("train_recompute_method")
    )
    lines = [
        f"{r['model_name']} on {r['device_name']}, config_id {r['config_id']}: status {r['status'].upper()}",
        f"layout  dp={r['parallel_dp']} tp={r['parallel_tp']} pp={r['parallel_pp']} cp={r['parallel_cp']} "
        f"zero={r['parallel_zero_stage']}{_layers(r)}{_ep(r)}  seq {r['train_seq_len']} × micro-batch "
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
            said = "traced" if r.get("memory_method") == "fake" else "measured"
            lines.append(
                f"  estimate (engine torch): {human(r['est_total_bytes'])} → {said}/estimate {ratio:.2f}"
            )
        levels = levels_line(r, threshold)
        if levels:
            lines.append(levels)
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
