"""``harness estimate``'s table: every term of the most-loaded rank, its stages, the levels, the verdict."""

from __future__ import annotations

from harness.cli.render.common import TERM_MEANINGS, human, layout_line, train_line, verdict
from harness.estimate.core import Estimate
from harness.estimate.terms import STATE_TERMS, TERMS
from harness.spec import config_id

MAX_STAGE_COLUMNS = 6
# The reserved level's mechanism terms (harness.estimate.segments), printed where they are not 0.
SEGMENT_LABELS = (
    ("reduce_stream", "gradient-reduction stream"),
    ("fsdp_root", "FSDP2 root unit's cached blocks"),
    ("loss_logits", "the loss's cached logits"),
    ("recompute_packing", "recomputed blocks' inputs packed into freed blocks"),
    ("recompute_working_set", "recomputed blocks' working set free at the loss"),
    ("grad_accumulation", "accumulated gradients' remainders in activation blocks"),
    ("embedding_grad", "stage 0's whole embedding gradients"),
    ("first_backward", "first backward's gradients beside freed activations"),
    ("optimizer_step_segments", "optimizer step's new segments"),
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
    outside = est.outside_allocator_bytes
    said = verdict(est.device_total_bytes, est.capacity_bytes, threshold, est.total_bytes + outside)
    reserved = est.reserved_terms()
    lines += [
        "",
        "peak = params + grads + optimizer + max(activations and buffers, optimizer step)",
        f"most-loaded rank: stage {est.worst.stage}, {human(est.total_bytes)} of "
        f"{human(est.capacity_bytes)} = {est.utilisation:.1%} allocated (the tensors)",
        f"reserved by the caching allocator: {human(est.reserved_total_bytes)} (segment rounding "
        f"{human(reserved['segment_rounding'])}, "
        + "".join(f"{label} {human(reserved[k])}, " for k, label in SEGMENT_LABELS if reserved[k])
        + f"cuBLAS workspace {human(reserved['cublas_workspace'])}; fragmentation: "
        + ("fitted, below)" if profile is not None else "calibration=PROFILE)"),
        f"device level (what runs out): {human(est.device_total_bytes)} = {util:.1%} utilisation"
        + ("" if calibrated_bytes is not None else f" → {said} (threshold {threshold:.0%})")
        + f" (CUDA context {human(est.outside_terms['cuda_context'])}, NCCL "
        f"{human(est.outside_terms['nccl'])})",
    ]
    if calibrated_bytes is not None:
        from harness.estimate.levels import verdict_bytes

        device = verdict_bytes(est, profile)
        cal_util = device / est.capacity_bytes
        cal_verdict = verdict(
            device, est.capacity_bytes, threshold, calibrated_bytes + est.outside_allocator_bytes
        )
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
