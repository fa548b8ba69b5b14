"""`harness report`: a markdown report with figures, every number computed from a results directory.

The same evaluation as `harness calibrate` (analysis.calibrate.evaluate), so the two agree; the text is
deterministic (sorted, fixed formats, no dates or host names), so regenerating it from the same data
gives the same file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from harness.analysis.calibrate import ESTIMATORS, GROUP_WORDS, MIB, PAPER_THRESHOLD, Evaluation, evaluate
from harness.analysis.markdown import pct as _pct
from harness.analysis.markdown import table as _table
from harness.analysis.plots import all_figures, fastest_layout, throughput_unit, world_of
from harness.analysis.reserved import reserved_section
from harness.analysis.stages import stages_section
from harness.analysis.steptime import StepTimeEvaluation, evaluate_step_time
from harness.estimate.steptime import TERMS as STEP_TIME_TERMS
from harness.estimate.steptime import UNITS
from harness.runner.record import STATUSES


def layout_label(r: pd.Series) -> str:
    """``dp2 tp2 pp2/1f1b cp1 zero3 mbs4 rc=none``: a run's layout in one short line."""
    pp = f"pp{int(r['parallel_pp'])}"
    if r["parallel_pp"] > 1:
        sched = str(r["parallel_pp_schedule"]).replace(
            "interleaved_1f1b", f"i1f1b×{int(r['parallel_virtual_stages'])}"
        )
        pp += f"/{sched}"
        layers = r.get("parallel_pp_layers")
        if layers is not None and not isinstance(layers, float) and len(layers):  # (NaN: older rows)
            pp += "[" + "+".join(str(int(n)) for n in layers) + "]"
    sp = "" if r["parallel_tp"] == 1 else ("+sp" if r["parallel_sequence_parallel"] else "-sp")
    return (
        f"dp{int(r['parallel_dp'])} tp{int(r['parallel_tp'])}{sp} {pp} cp{int(r['parallel_cp'])} "
        f"zero{int(r['parallel_zero_stage'])} mbs{int(r['train_micro_batch_size'])} "
        f"rc={r['train_recompute']}" + _extras(r)
    )


def _extras(r: pd.Series) -> str:
    """What the second round's grids vary, shown only where it differs from the default: every N-th
    layer recomputed (``/N``; Megatron's methods as ``/uniformN``, ``/blockN``), tied embeddings, the
    attention kernel, the micro-batch count."""
    out = ""
    every = r.get("train_recompute_every")
    method = r.get("train_recompute_method")
    if every is not None and every == every and method in ("uniform", "block"):
        out += f"/{method}{int(every)}"
    elif every is not None and every == every and int(every) > 1:
        out += f"/{int(every)}"
    if bool(r.get("model_tie_embeddings", False)):
        out += " tied"
    if r.get("train_attention", "flash") not in ("flash", None):
        out += f" attn={r['train_attention']}"
    m = r.get("train_num_microbatches")
    if m is not None and m == m and int(m) > max(1, int(r["parallel_pp"])):
        out += f" m{int(m)}"
    ep = r.get("parallel_ep")
    if ep is not None and ep == ep and int(ep) > 1:
        out += f" ep{int(ep)}"
    return out


def status_section(frame: pd.DataFrame) -> list[str]:
    counts = frame["status"].value_counts()
    rows = [[s, str(int(counts.get(s, 0)))] for s in STATUSES if counts.get(s, 0)]
    launched = int(sum(counts.get(s, 0) for s in ("ok", "oom", "timeout", "crash")))
    ran = frame[frame["status"].isin(["ok", "oom", "timeout", "crash"])]
    by_world = ran.groupby([world_of(ran), "status"]).size().unstack(fill_value=0)
    world_rows = [
        [str(int(w)), *(str(int(by_world.loc[w].get(s, 0))) for s in ("ok", "oom", "timeout", "crash"))]
        for w in sorted(by_world.index)
    ]
    oom_share = counts.get("oom", 0) / launched if launched else float("nan")
    lines = [
        "## Runs",
        "",
        f"{len(frame)} points, {launched} launched (the others were impossible layouts, recorded without "
        f"running); {oom_share:.1%} of the launched runs ran out of memory.",
        "",
        *_table(["status", "points"], rows),
        "",
        *_table(["world size", "ok", "oom", "timeout", "crash"], world_rows),
    ]
    return lines


def memory_section(ev: Evaluation) -> list[str]:
    rows = []
    for name in ESTIMATORS:
        m = ev.metrics[name]
        rows.append(
            [
                name,
                _pct(m["median_ape"]),
                _pct(m["p95_ape"]),
                _pct(m["max_under_prediction"]),
                _pct(m["safe_threshold"]),
                str(m["excluded_at_safe"]),
                str(m["oom_below_paper_threshold"]),
                str(m["excluded_at_paper_threshold"]),
            ]
        )
    n, folds = int(ev.data.measured.sum()), len(ev.fold_coefs)
    best_raw = min(ESTIMATORS[:-1], key=lambda k: ev.metrics[k]["median_ape"])
    cal, raw = ev.metrics["calibrated"], ev.metrics[best_raw]
    verdict = (
        "lower than every raw engine's"
        if all(cal["median_ape"] < ev.metrics[k]["median_ape"] for k in ESTIMATORS[:-1])
        else "not lower than every raw engine's"
    )
    return [
        "## Peak memory: how far each estimator can be trusted",
        "",
        f"{len(ev.data.frame)} runs with a known outcome (ok or out of memory), {n} of them with a measured "
        f"peak (on CPU a simulated out-of-memory run keeps its measured peak). The calibrated estimator's "
        f"predictions are held out: each comes from a fit that never saw a run of the same "
        f"{GROUP_WORDS[ev.group_by]} ({folds} folds, GroupKFold).",
        "",
        *_table(
            [
                "estimator",
                "median APE",
                "p95 APE",
                "worst under-prediction",
                "safe threshold",
                "fitting runs above it",
                "OOM runs under 80 %",
                "fitting runs over 80 %",
            ],
            rows,
        ),
        "",
        f"APE = |predicted − measured| / measured. The calibrated held-out median error "
        f"({cal['median_ape']:.2%}) is {verdict} (best raw: {best_raw}, {raw['median_ape']:.2%}).",
        "",
        "Safe threshold: the largest predicted utilisation below which no run ran out of memory — the "
        f'statistic behind the paper\'s rule ("below {PAPER_THRESHOLD:.0%}, no run ran out of memory"), '
        "measured here for each estimator ('none': no run ran out of memory); 'fitting runs above it' are "
        "runs it would wrongly exclude. "
        "The last two columns apply the paper's 80 % rule as published.",
    ]


def calibration_section(ev: Evaluation) -> list[str]:
    model = ev.model
    lo, hi = ev.fold_coefs.min(axis=0), ev.fold_coefs.max(axis=0)
    rows = [
        [name, f"{c:.3f}", "no data (kept at 1)" if name in model.unfitted_ else f"{a:.3f} – {b:.3f}"]
        for name, c, a, b in zip(model.features, model.coef_, lo, hi, strict=True)
    ]
    rows.append(["constant", f"{model.constant_bytes_ / MIB:.1f} MiB", ""])
    frag = ev.fragmentation
    frag_line = _fragmentation_lines(frag)
    return [
        "## Calibration profile",
        "",
        f"Fitted on all {int(ev.data.measured.sum())} measured runs, engine `{ev.engine}`, non-negative "
        "least squares on the relative error:",
        "",
        f"`peak ≈ {model.describe()}`",
        "",
        *_table(["term", "coefficient", "range over folds"], rows),
        "",
        frag_line,
    ]


def throughput_section(frame: pd.DataFrame) -> list[str]:
    if "tflops_per_device" not in frame:
        return ["## Throughput", "", "No run has a throughput figure (fake runs time nothing)."]
    ok = frame[(frame["status"] == "ok") & frame["tflops_per_device"].notna()].copy()
    if ok.empty:
        return ["## Throughput", "", "No successful run has a throughput figure."]
    ok["world"] = world_of(ok)
    scale, unit = throughput_unit(ok)
    rows = []
    for (model, world), sub in sorted(
        ok.groupby(["model_name", "world"]), key=lambda kv: (kv[0][0], kv[0][1])
    ):
        sub = sub.sort_values(["tflops_per_device", "config_id"], ascending=[False, True])
        best = sub.iloc[0]
        dp_only = sub[(sub["parallel_tp"] == 1) & (sub["parallel_pp"] == 1) & (sub["parallel_cp"] == 1)]
        base = dp_only.iloc[0] if len(dp_only) else None
        ratio = "" if base is None else f"{best['tflops_per_device'] / base['tflops_per_device']:.2f}×"
        rows.append(
            [
                str(model),
                str(int(world)),
                str(len(sub)),
                layout_label(best),
                f"{best['tflops_per_device'] * scale:.2f}",
                "" if base is None else f"{layout_label(base)}: {base['tflops_per_device'] * scale:.2f}",
                ratio,
            ]
        )
    return [
        "## Throughput: the fastest layout per model and world size",
        "",
        f"Model FLOPs per step (Megatron formula) / median step time / ranks, in {unit} per rank, over the "
        "successful runs; the best data-parallel-only run of the same model and world size is the baseline.",
        "",
        *_table(
            ["model", "ranks", "ok runs", "fastest layout", unit, "best dp-only", "fastest / dp-only"], rows
        ),
    ]


def fastest_section(st: StepTimeEvaluation | None, out: Path) -> list[str]:
    """Which layout is fastest: the step-time model's held-out ranking against the measured one, per
    (model, world size) group, with its figure (drawn into ``out/figures``)."""
    title = "## Which layout is fastest: predicted vs measured"
    if st is None:
        return [title, "", "Too few timed runs (or one world size only) to fit the step-time model."]
    m = st.metrics
    rows = [
        [str(g["model"]), str(g["world"]), str(g["runs"]), f"{g['spearman']:.2f}", _pct(g["top1_ratio"])]
        for g in m["groups"]
    ]
    png, svg = (path.relative_to(out).as_posix() for path in fastest_layout(st, out / "figures"))
    caption = (
        "Held-out predicted vs measured tokens/s per model and world size; rings: the predicted and the "
        "measured fastest layout."
    )
    spread = st.frame["step_time_spread"] if "step_time_spread" in st.frame else pd.Series(dtype=float)
    spread = spread[st.frame["status"] == "ok"].dropna()
    noise = (
        f"The runs time several steps: the median spread ((max − min) / median of the slowest rank's "
        f"steps) is {spread.median():.1%} over {len(spread)} runs."
        if len(spread)
        else "The runs time one step each (no `step_time_spread`): differences of a few percent are noise."
    )
    rho = "none" if m["spearman_median"] is None else f"{m['spearman_median']:.2f}"
    model, lo, hi = st.model, st.fold_coefs.min(axis=0), st.fold_coefs.max(axis=0)
    term_rows = [
        [
            k,
            f"{model.coefficients[k]:.4g}",
            UNITS[k],
            "no run had it" if k in model.unfitted else f"{a:.4g} – {b:.4g}",
        ]
        for k, a, b in zip(STEP_TIME_TERMS, lo, hi, strict=True)
    ]
    term_rows.append(["constant", f"{model.constant_s:.4g} s", "", ""])
    lines = [
        title,
        "",
        f"The step-time model (named terms, harness/estimate/steptime.py) fitted non-negative on "
        f"{m['fit_runs']} timed runs; each prediction comes from a fit that never saw a run of the same "
        f"{GROUP_WORDS[st.group_by]} ({len(st.fold_coefs)} folds). Judged on the {m['judged_runs']} runs "
        f"that fit: held-out median APE of the step time {_pct(m['median_ape'])} (p95 "
        f"{_pct(m['p95_ape'])}); within each model and world size, the Spearman correlation of predicted "
        "and measured tokens/s, and the measured tokens/s of the layout predicted fastest over the best "
        f"measured (top-1). Medians over the groups: Spearman {rho}, top-1 "
        f"{_pct(m['top1_ratio_median'])}.",
        "",
        *_table(["model", "ranks", "runs that fit", "Spearman", "top-1"], rows),
        "",
        noise,
        "",
        f"The profile's `step_time` section, fitted on every timed run ({st.model.device}; seconds = "
        "coefficient × term):",
        "",
        *_table(["term", "coefficient", "unit of the term", "range over folds"], term_rows),
        "",
        f"![{caption}]({png})",
        "",
        f"*{caption}* ([SVG]({svg}))",
    ]
    return lines


def stack_line(frame: pd.DataFrame) -> str:
    """Which runnable stacks' choices the launched runs were made with (harness.spec.stacks; issue 28),
    in one line: ``Stack: of 629 launched runs, 629 were made with stack=harness's choices, 481 with
    torchtitan's ...``."""
    from harness.spec import from_flat
    from harness.spec.stacks import STACKS, stacks_of

    launched = frame[frame["status"] != "invalid"]
    names = [name for name, stack in STACKS.items() if stack.runnable]
    counts = dict.fromkeys(names, 0)
    for row in launched.to_dict("records"):
        for name in set(stacks_of(from_flat(row))) & set(counts):
            counts[name] += 1
    ordered = sorted(names, key=lambda n: -counts[n])
    made = f"{counts[ordered[0]]} were made with stack={ordered[0]}'s choices" + "".join(
        f", {counts[n]} with {n}'s" for n in ordered[1:]
    )
    return (
        f"Stack: of {len(launched)} launched runs, {made} (a run with nothing to choose, such as one "
        "micro-batch on one data-parallel rank, counts for each; recomputation is the study's own axis, "
        "not counted; docs/stacks.md)."
    )


def write_report(
    frame: pd.DataFrame,
    *,
    out_dir: str | Path,
    results_dir: str,
    also_results: Sequence[str] = (),
    engine: str = "torch",
    group_by: str = "world",
) -> Path:
    """Evaluate, draw every figure into ``out_dir/figures`` and write ``out_dir/report.md``
    (``also_results``: the other directories whose runs ``frame`` holds, named in its first lines)."""
    out = Path(out_dir)
    ev = evaluate(frame, engine=engine, group_by=group_by)
    figures = all_figures(ev, frame, out / "figures")
    dirs = " + ".join([results_dir, *also_results])
    command = f"harness report results_dir={results_dir}"
    if also_results:
        command += f" calibrate.also_results=[{','.join(also_results)}] report.out={out_dir}"
    if group_by != "world":
        command += f" calibrate.group_by={group_by}"
    where = "that directory" if not also_results else "those directories"
    lines = [
        f"# harness report: `{dirs}`",
        "",
        f"Written by `{command}` from the runs in {where}; every number below is computed from them.",
        "",
        stack_line(frame),
        "",
        *status_section(frame),
        "",
        *memory_section(ev),
        "",
        *stages_section(ev),
        *_spaced(reserved_section(ev)),
        *calibration_section(ev),
        "",
        *throughput_section(frame),
        "",
        *fastest_section(evaluate_step_time(frame, group_by=group_by), out),
        "",
        "## Figures",
        "",
    ]
    captions = {
        "predicted_vs_measured": "Predicted vs measured peak memory per rank, one panel per estimator.",
        "utilisation_vs_outcome": "Out of memory against predicted utilisation, with the learned safe "
        "threshold and the paper's 80 % rule.",
        "residuals_by_term": "Fitted coefficient per term, and held-out error by layout family.",
        "throughput_tp_pp": "Best throughput per rank by tensor × pipeline degree.",
    }
    for name, paths in figures.items():
        png = paths[0].relative_to(out).as_posix()
        lines += [
            f"![{captions[name]}]({png})",
            "",
            f"*{captions[name]}* ([SVG]({paths[1].relative_to(out).as_posix()}))",
            "",
        ]
    path = out / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def _spaced(lines: list[str]) -> list[str]:
    """A section followed by a blank line; nothing for an empty one."""
    return [*lines, ""] if lines else []


def _fragmentation_lines(frag: dict | None) -> str:
    """The fragmentation term: its fit and its held-out error at the reserved level."""
    if not frag:
        return (
            "Fragmentation: not fitted (no run reports a reserved peak: neither a CUDA one nor one "
            "replayed from a trace)."
        )
    h = frag["held_out"]
    source = (
        "measured on CUDA"
        if frag["target"] == "peak_reserved_bytes"
        else "replayed through the caching-allocator model from each run's own trace"
    )
    safe = (
        "none ran out at the reserved level" if h["safe_threshold"] is None else f"{h['safe_threshold']:.1%}"
    )
    over = " − mechanism" if frag.get("over_mechanism") else ""
    level = (
        "calibrated allocated + mechanism + fragmentation" if over else "calibrated allocated + fragmentation"
    )
    return (
        f"Fragmentation (reserved − allocated, {source}; {h['runs']} runs): `reserved − allocated{over} ≈ "
        f"{frag['summary']}`"
        + (
            " (mechanism: the estimator's reserved terms derived from the allocator's rules, "
            "harness/estimate/segments.py; 0 on the CPU)"
            if over
            else ""
        )
        + f". At the reserved level ({level}, held out): "
        f"median APE {h['median_ape']:.2%}, p95 {h['p95_ape']:.2%}, worst under-prediction "
        f"{h['max_under_prediction']:.2%}; safe threshold against reserved {safe}. The median run's "
        f"reserved peak is {h['median_fragmentation_share']:.1%} fragmentation."
    )
