"""Figures from a results frame and its calibration evaluation (matplotlib, no torch).

Each function draws one figure and saves it as PNG and SVG (deterministic files: no dates, fixed SVG
ids) and returns the paths. Memory in GiB where the peaks reach 8 GiB, else MiB (2^20 bytes); a fake
run's peak is "traced", a real one's "measured"; utilisation as a fraction of the device's capacity,
throughput in the unit the data needs (TFLOP/s on GPUs, GFLOP/s on this CPU).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, never a window (and no display on a cluster node)
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from harness.analysis.calibrate import ESTIMATORS, MIB, PAPER_THRESHOLD, Evaluation

plt.rcParams.update({"svg.hashsalt": "harness", "figure.dpi": 100, "font.size": 9})
LABELS = {
    "paper": "paper (Fujii et al. closed form)",
    "megatron": "megatron (corrected closed form)",
    "torch": "torch (raw, term by term)",
    "calibrated": "calibrated (held-out folds)",
}
STATUS_STYLE = {"ok": ("tab:blue", "o", "ok"), "oom": ("tab:red", "x", "out of memory")}


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.svg"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return paths


def _capacities(ev: Evaluation, unit: float) -> list[float]:
    """The device capacities of the runs (in ``unit``), at most three (the figure's lines)."""
    return sorted({float(c) / unit for c in np.unique(ev.data.capacity)})[:3]


def memory_unit(peaks_bytes: np.ndarray) -> tuple[float, str]:
    """GiB where the peaks reach 8 GiB (paper scale: MiB axes read 10^5; issue 31), else MiB."""
    finite = peaks_bytes[np.isfinite(peaks_bytes)]
    return (2.0**30, "GiB") if finite.size and finite.max() >= 8 * 2**30 else (float(MIB), "MiB")


def peak_word(frame: pd.DataFrame) -> str:
    """What the runs' peaks are: "traced" where every run is a fake trace, else "measured"."""
    methods = frame.get("memory_method")
    return "traced" if methods is not None and len(frame) and (methods == "fake").all() else "measured"


def predicted_vs_measured(ev: Evaluation, out_dir: Path) -> list[Path]:
    """Predicted vs measured peak, log axes, identity and +/-10 % band, one panel per estimator, with
    the device capacity (a run right of it ran out of memory, a prediction above it says it would).
    No panel is in-sample: the three engines fit nothing, and the calibrated one predicts each run
    from a fit that did not see its group (the panels say so)."""
    data = ev.data
    m = data.measured
    peaks = data.frame["peak_allocated_bytes"].to_numpy(dtype=float)
    unit, unit_name = memory_unit(peaks[m])
    word = peak_word(data.frame)
    y = peaks / unit
    status = data.frame["status"].to_numpy()
    fig, axes = plt.subplots(2, 2, figsize=(9, 8.5), sharex=True, sharey=True)
    lo = min(y[m].min(), *(ev.predictions[n][m].min() / unit for n in ESTIMATORS)) * 0.8
    hi = max(y[m].max(), *(ev.predictions[n][m].max() / unit for n in ESTIMATORS)) * 1.25
    line = np.array([lo, hi])
    for ax, name in zip(axes.flat, ESTIMATORS, strict=True):
        pred = ev.predictions[name] / unit
        ax.fill_between(line, line * 0.9, line * 1.1, color="0.85", label="±10 %")
        ax.plot(line, line, color="0.3", lw=1, label=f"predicted = {word}")
        for st, (color, marker, label) in STATUS_STYLE.items():
            rows = m & (status == st)
            if rows.any():
                ax.scatter(
                    y[rows], pred[rows], s=14, c=color, marker=marker, lw=1, label=f"{label} ({rows.sum()})"
                )
        for k, cap in enumerate(_capacities(ev, unit)):
            label = "device capacity" if k == 0 else None
            ax.axvline(cap, color="tab:red", ls="--", lw=0.9, label=label)
            ax.axhline(cap, color="tab:red", ls="--", lw=0.9)
        met = ev.metrics[name]
        sample = (
            f"out-of-sample: held out by {ev.group_by}"
            if name == "calibrated"
            else "analytical: nothing fitted"
        )
        ax.set_title(
            f"{LABELS[name]}\n{sample}; median APE {met['median_ape']:.1%}, p95 {met['p95_ape']:.1%}",
            fontsize=9,
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1-2-5 steps, not 10^5 (issue 31)
            axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel(f"{word} peak allocated per rank ({unit_name})")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"predicted peak per rank ({unit_name})")
    axes[0, 0].legend(loc="upper left", fontsize=8)
    fig.suptitle(
        f"Predicted vs {word} peak memory ({int(m.sum())} runs with a {word} peak); no panel is "
        "in-sample; dashed red: device capacity"
    )
    return _save(fig, out_dir, "predicted_vs_measured")


UTILISATION_AXIS = (0.5, 1.3)  # where fit-or-not decisions are made; the rest is counted, not drawn


def utilisation_vs_outcome(ev: Evaluation, out_dir: Path) -> list[Path]:
    """Each run's predicted utilisation and whether it ran out of memory, per estimator, with the
    learned safe threshold and the paper's 80 % rule, on a linear axis over 0.5-1.3 (runs outside
    it are counted in each panel's title)."""
    data = ev.data
    oom = data.oom
    rng = np.random.default_rng(0)  # jitter only; fixed so the figure is reproducible
    jitter = rng.uniform(-0.18, 0.18, size=len(oom))
    fig, axes = plt.subplots(len(ESTIMATORS), 1, figsize=(9, 2.1 * len(ESTIMATORS)), sharex=True)
    for ax, name in zip(axes, ESTIMATORS, strict=True):
        util = ev.predictions[name] / data.capacity
        for st, (color, marker, label) in STATUS_STYLE.items():
            rows = oom if st == "oom" else ~oom
            ax.scatter(util[rows], (1.0 if st == "oom" else 0.0) + jitter[rows], s=12, c=color, marker=marker,
                       lw=1, label=f"{label} ({rows.sum()})")  # fmt: skip
        safe = ev.metrics[name]["safe_threshold"]
        ax.axvline(PAPER_THRESHOLD, color="tab:green", ls="--", lw=1.2, label="paper's 80 % rule")
        if safe is not None:
            ax.axvline(safe, color="k", lw=1.2, label=f"safe threshold {safe:.0%} (learned)")
        ax.axvline(1.0, color="0.6", lw=0.8, ls=":")
        ax.set_yticks([0, 1], ["ran", "out of\nmemory"])
        ax.set_ylim(-0.5, 1.5)
        lo, hi = UTILISATION_AXIS
        ax.set_xlim(lo, hi)
        below, above = int((util < lo).sum()), int((util > hi).sum())
        ax.set_title(
            f"{LABELS[name]}   (not shown: {below} runs below {lo:.0%}, {above} above {hi:.0%})",
            fontsize=9,
            loc="left",
        )
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    axes[-1].set_xlabel("predicted peak / device capacity (utilisation)")
    axes[-1].xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    fig.suptitle("Out of memory against predicted utilisation")
    return _save(fig, out_dir, "utilisation_vs_outcome")


def throughput_unit(frame: pd.DataFrame) -> tuple[float, str]:
    """(scale, unit) for TFLOP/s per device: GFLOP/s when every value is under 1 TFLOP/s (a CPU)."""
    top = frame["tflops_per_device"].max()
    return (1e3, "GFLOP/s") if top < 1.0 else (1.0, "TFLOP/s")


def throughput_heatmap(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The best throughput per device for each tp x pp, one panel per model and world size that has
    successful runs, each with only the tp and pp degrees it ran (best over dp, cp, ZeRO, micro-batch
    and the rest: what a user who tuned everything else would get). No empty panel (issue 31: 14 of
    24 were)."""
    ok = frame[(frame["status"] == "ok") & frame["tflops_per_device"].notna()].copy()
    ok["world"] = world_of(ok)
    ok = ok[ok["world"] > 1]
    pairs = sorted({(m, int(w)) for m, w in zip(ok["model_name"], ok["world"], strict=True)})
    scale, unit = throughput_unit(ok)
    cols = min(4, max(1, len(pairs)))
    rows = max(1, -(-len(pairs) // cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.9 * cols, 3.4 * rows), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[len(pairs) :]:
        ax.set_visible(False)
    for ax, (model, world) in zip(axes.flat, pairs, strict=False):
        sub = ok[(ok["model_name"] == model) & (ok["world"] == world)]
        tps, pps = sorted(sub["parallel_tp"].unique()), sorted(sub["parallel_pp"].unique())
        grid = np.full((len(tps), len(pps)), np.nan)
        for (tp, pp), val in sub.groupby(["parallel_tp", "parallel_pp"])["tflops_per_device"].max().items():
            grid[tps.index(tp), pps.index(pp)] = val * scale
        # A colour scale per panel: models and world sizes differ by orders of magnitude, and one shared
        # scale leaves every small panel in its dark end.
        vmin, vmax = np.nanmin(grid), np.nanmax(grid)
        if vmin == vmax:
            vmin = 0.0
        im = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax, origin="lower")
        fig.colorbar(im, ax=ax, shrink=0.8)
        for (a, b), val in np.ndenumerate(grid):
            if not np.isnan(val):
                ax.text(b, a, f"{val:.1f}", ha="center", va="center", fontsize=8,
                        color="w" if val < vmin + (vmax - vmin) * 0.6 else "k")  # fmt: skip
        ax.set_xticks(range(len(pps)), [str(p) for p in pps])
        ax.set_yticks(range(len(tps)), [str(t) for t in tps])
        ax.set_xlabel("pp")
        ax.set_ylabel("tp")
        ax.set_title(f"{model}, {world} ranks", fontsize=9)
    fig.suptitle(
        f"Best model {unit} per rank by tensor x pipeline degree (blank cell: no successful run); each "
        "panel has its own colour scale"
    )
    return _save(fig, out_dir, "throughput_tp_pp")


def world_of(frame: pd.DataFrame) -> pd.Series:
    """Each run's number of ranks, dp·tp·pp·cp."""
    return frame["parallel_dp"] * frame["parallel_tp"] * frame["parallel_pp"] * frame["parallel_cp"]


def axes_used(frame: pd.DataFrame) -> pd.Series:
    """Which parallel axes a run uses: 'single', 'dp', 'tp', 'dp+pp', ... (dp counted when > 1)."""
    names = ("dp", "tp", "pp", "cp")
    return frame.apply(lambda r: "+".join(n for n in names if r[f"parallel_{n}"] > 1) or "single", axis=1)


def residuals_by_term(ev: Evaluation, out_dir: Path) -> list[Path]:
    """Left: the fitted coefficient of each term (final fit; bars span the cross-validation folds).
    Right: the held-out relative error of the raw torch engine and of the calibrated one, grouped by the
    parallel axes a run uses."""
    model, data = ev.model, ev.data
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.4]})
    names = list(model.features)
    y = np.arange(len(names))
    lo, hi = ev.fold_coefs.min(axis=0), ev.fold_coefs.max(axis=0)
    colors = ["0.6" if n in model.unfitted_ else "tab:blue" for n in names]
    # Bars grow from 1 (the analytical term as is) on a linear axis centred on 1.
    left.barh(y, model.coef_ - 1.0, left=1.0, color=colors)
    spread = [model.coef_ - np.minimum(lo, model.coef_), np.maximum(hi, model.coef_) - model.coef_]
    left.errorbar(model.coef_, y, xerr=spread, fmt="none", ecolor="k", lw=1, capsize=2)
    left.axvline(1.0, color="tab:green", ls="--", lw=1, label="1 = the analytical term as is")
    left.set_yticks(y, names)
    left.invert_yaxis()
    reach = max(0.1, float(np.max(np.abs(np.concatenate([lo, hi, model.coef_]) - 1.0)))) * 1.15
    left.set_xlim(1.0 - reach, 1.0 + reach)
    left.set_xlabel("coefficient (grey: no data, kept at 1)")
    left.set_title(f"Fitted coefficient per term; constant {model.constant_bytes_ / MIB:.1f} MiB", fontsize=9)
    left.legend(fontsize=8, loc="lower right")
    m = data.measured
    measured = data.frame["peak_allocated_bytes"].to_numpy(dtype=float)
    groups = axes_used(data.frame)[m].to_numpy()
    order = sorted(set(groups), key=lambda g: (g.count("+"), g))
    pos = np.arange(len(order))
    for k, (name, color) in enumerate((("torch", "tab:orange"), ("calibrated", "tab:blue"))):
        err = (ev.predictions[name][m] - measured[m]) / measured[m] * 100
        parts = right.boxplot([err[groups == g] for g in order], positions=pos + (k - 0.5) * 0.35, widths=0.3,
                              patch_artist=True, showfliers=True, flierprops={"markersize": 3})  # fmt: skip
        for box in parts["boxes"]:
            box.set_facecolor(color)
        right.plot([], [], color=color, lw=6, label=LABELS[name])
    right.axhline(0, color="0.3", lw=1)
    right.axhspan(-10, 10, color="0.9", zorder=0)
    labels = [f"{g} ({(groups == g).sum()})" for g in order]
    right.set_xticks(pos, labels, fontsize=8, rotation=40, ha="right", rotation_mode="anchor")
    right.set_xlabel("parallel axes used (runs)")
    word = peak_word(data.frame)
    right.set_ylabel(f"(predicted − {word}) / {word} (%)")
    right.set_title("Held-out error by layout family (grey band ±10 %)", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out_dir, "residuals_by_term")


def all_figures(ev: Evaluation, frame: pd.DataFrame, out_dir: str | Path) -> dict[str, list[Path]]:
    out = Path(out_dir)
    figures = {
        "predicted_vs_measured": predicted_vs_measured(ev, out),
        "utilisation_vs_outcome": utilisation_vs_outcome(ev, out),
        "residuals_by_term": residuals_by_term(ev, out),
    }
    timed = "tflops_per_device" in frame and frame["tflops_per_device"].notna().any()
    if (frame["status"] == "ok").any() and timed:  # (fake runs time nothing)
        figures["throughput_tp_pp"] = throughput_heatmap(frame, out)
    return figures


def fastest_layout(st, out_dir: Path) -> list[Path]:
    """Which layout is fastest, predicted vs measured: one panel per (model, world size) group of runs
    that fit, held-out predicted tokens/s against measured tokens/s (log axes, identity line), the
    layout predicted fastest ringed in red and the measured fastest in black; each title gives the
    group's Spearman correlation and top-1 ratio. ``st``: harness.analysis.steptime.StepTimeEvaluation."""
    from matplotlib.ticker import NullFormatter

    runs = st.frame[st.frame["status"] == "ok"]
    groups = {(g["model"], g["world"]): g for g in st.metrics["groups"]}
    models = sorted({m for m, _ in groups})
    worlds = sorted({w for _, w in groups})
    fig, axes = plt.subplots(
        len(models), len(worlds), figsize=(2.9 * len(worlds), 2.9 * len(models)), squeeze=False
    )
    for i, model in enumerate(models):
        for j, world in enumerate(worlds):
            ax = axes[i, j]
            g = groups.get((model, world))
            sub = runs[(runs["st_model"] == model) & (runs["st_world"] == world)]
            if g is None or sub.empty:
                ax.set_axis_off()
                continue
            measured = (sub["st_tokens_per_step"] / sub["step_time_s"]).to_numpy()
            predicted = (sub["st_tokens_per_step"] / sub["predicted_step_time_s"]).to_numpy()
            ax.scatter(measured, predicted, s=12, c="tab:blue", alpha=0.7, lw=0)
            best_pred, best_meas = int(np.argmax(predicted)), int(np.argmax(measured))
            ax.scatter(measured[best_pred], predicted[best_pred], s=90, facecolors="none",
                       edgecolors="tab:red", lw=1.5, label="predicted fastest")  # fmt: skip
            ax.scatter(measured[best_meas], predicted[best_meas], s=40, facecolors="none",
                       edgecolors="k", lw=1.2, label="measured fastest")  # fmt: skip
            lo = min(measured.min(), predicted.min()) * 0.8
            hi = max(measured.max(), predicted.max()) * 1.25
            ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            for axis in (ax.xaxis, ax.yaxis):  # major labels only: minor ones collide on short log ranges
                axis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(
                f"{model}, {world} ranks ({g['runs']} runs)\nSpearman {g['spearman']:.2f}, "
                f"top-1 {g['top1_ratio']:.0%}",
                fontsize=8,
            )
            if i == len(models) - 1:
                ax.set_xlabel("measured tokens/s")
            if j == 0:
                ax.set_ylabel("predicted tokens/s (held out)")
    handles, labels = next(
        (ax.get_legend_handles_labels() for ax in axes.flat if ax.get_legend_handles_labels()[0]), ([], [])
    )
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    m = st.metrics
    medians = (
        f" (median Spearman {m['spearman_median']:.2f}, top-1 {m['top1_ratio_median']:.0%})"
        if m["spearman_median"] is not None
        else ""
    )
    fig.suptitle(
        f"Which layout is fastest: step time predicted held out by {st.group_by} vs measured{medians}",
        fontsize=9,
    )
    fig.tight_layout()
    return _save(fig, out_dir, "fastest_layout")
