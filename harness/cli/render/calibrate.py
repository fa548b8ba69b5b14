"""``harness calibrate``'s tables: every estimator's held-out accuracy, the profile, the step-time fit."""

from __future__ import annotations


def calibration_table(ev, *, profile_path: str, reserved: dict | None = None) -> str:
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
    for name, what in (("stages", "every pipeline stage"), ("partitions", "every ZeRO-1 partition")):
        if name in ev.stage_metrics:
            raw, cal = ev.stage_metrics[name]["raw"], ev.stage_metrics[name]["calibrated"]
            lines.append(
                f"{what} ({raw['stages']}), within 2 % under: {ev.engine} {raw['within_2pct_under']:.1%} "
                f"(worst under {raw['worst_under']:.1%}), calibrated held out {cal['within_2pct_under']:.1%} "
                f"(worst under {cal['worst_under']:.1%})"
            )
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
    if reserved:  # (harness/analysis/reserved.py)
        lines.append(f"reserved level against {reserved['target']}:")
        for name, m in reserved["predictions"].items():
            lines.append(
                f"  {name:<32} median {m['median_error']:+.1%}, median APE {m['median_ape']:.1%}, "
                f"p95 {m['p95_ape']:.1%}, worst under {m['max_under_prediction']:.1%} ({m['runs']} runs)"
            )
        card = reserved["on_card"]
        if card:
            counts = ", ".join(f"{k} {n}" for k, n in sorted(card["verdicts"].items()))
            lines.append(f"on the card ({card['runs']} runs replayed against its capacity): {counts}")
            for name, m in card["levels"].items():
                safe = "none" if m["safe_threshold"] is None else f"{m['safe_threshold']:.1%}"
                lines.append(
                    f"  {name:<20} safe threshold {safe} (excl. {m['excluded_at_safe']}), under 80 %: "
                    f"{m['out_under_paper_threshold']} out of memory, {m['flushed_under_paper_threshold']} "
                    f"after cache flushes; fitting over 80 %: {m['fitting_over_paper_threshold']}"
                )
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
