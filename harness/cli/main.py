"""`harness <command> [key=value ...]`: dispatch, one-line errors, exit codes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence

from harness import __version__
from harness.cli.config import ConfigError, compose, engine_name, run_spec
from harness.specs import InvalidSpec

USAGE = f"""harness {__version__}: which 4D-parallel training configuration fits in memory, and which runs
fastest.

usage: harness <command> [key=value ...]      (or: python -m harness <command> ...)

commands:
  estimate   analytical per-rank memory and FLOPs of one configuration, term by term, with a verdict
  plan       every valid layout for plan.gpus devices, the ones that fit ranked, with predicted memory
  run        one short real training step of the configuration: peak memory per rank, step time,
             TFLOP/s, MFU, loss; or how it failed (oom, timeout, crash, invalid). Exit 0 for any outcome
  sweep      a Hydra multirun (e.g. +study=cpu_smoke): every point one run, one parquet row in
             results_dir; impossible and finished points are not launched, so a rerun resumes
  results    status | compact [results_dir=DIR]: counts by status, or merge the runs into one file
  calibrate  fit coefficients on the estimator's terms to the runs in results_dir, cross-validated on
             held-out layouts; writes a profile that estimate/plan take as calibration=PATH
  report     results_dir=DIR: markdown report with figures (memory accuracy of every estimator, safe
             utilisation threshold, out-of-memory map, TFLOP/s by layout), every number from the runs

overrides are Hydra's: group=preset (model=llama3_8b device=h100_94gb engine=paper) and dotted keys
(parallel.tp=2 train.seq_len=8192 format=json). See sweeps/config.yaml for every key.
"""


def _output_settings(cfg: dict) -> tuple[str, float]:
    """``format`` and ``threshold``, checked."""
    fmt = cfg["format"]
    if fmt not in ("table", "json"):
        raise ValueError(f"format={fmt!r} must be table or json")
    try:
        threshold = float(cfg["threshold"])
    except (TypeError, ValueError):
        raise ValueError(f"threshold={cfg['threshold']!r} must be a number") from None
    if not threshold > 0:
        raise ValueError(f"threshold={threshold} must be > 0 (a fraction of device memory, e.g. 0.8)")
    return fmt, threshold


def _estimate(overrides: Sequence[str]) -> int:
    from harness.cli.render import estimate_table
    from harness.estimate import estimate

    cfg = compose(overrides)
    fmt, threshold = _output_settings(cfg)
    est = estimate(run_spec(cfg), engine=engine_name(cfg))
    profile = _profile(cfg)
    calibrated = profile.total_bytes(est) if profile else None
    if fmt == "json":
        record = est.as_record(threshold=threshold)
        if profile:
            util = calibrated / est.capacity_bytes
            record.update(
                calibration=profile.path,
                calibrated_total_bytes=calibrated,
                calibrated_utilisation=util,
                fits=util <= threshold,
            )
        print(json.dumps(record, indent=2))
    else:
        print(estimate_table(est, threshold=threshold, calibrated_bytes=calibrated, profile=profile))
    return 0


def _profile(cfg: dict):
    """The calibration profile named by ``calibration=`` (None when unset)."""
    if not cfg.get("calibration"):
        return None
    from harness.calibrate import load_profile

    return load_profile(cfg["calibration"])


def _plan(overrides: Sequence[str]) -> int:
    from harness.cli.render import plan_json, plan_table
    from harness.estimate.plan import PlanOptions, plan

    cfg = compose(overrides)
    fmt, threshold = _output_settings(cfg)
    p = cfg["plan"]
    opts = PlanOptions(
        gpus=int(p["gpus"]),
        global_batch_size=p["global_batch_size"],
        micro_batch_sizes=tuple(p["micro_batch_sizes"]),
        zero_stages=tuple(p["zero_stages"]),
        recompute=tuple(p["recompute"]),
        pp_schedules=tuple(p["pp_schedules"]),
        virtual_stages=tuple(p["virtual_stages"]),
        max_tp=int(p["max_tp"]),
        threshold=threshold,
        engine=engine_name(cfg),
        calibration=_profile(cfg),
    )
    result = plan(run_spec(cfg), opts)
    if fmt == "json":
        print(json.dumps(plan_json(result, opts), indent=2))
    else:
        print(plan_table(result, opts, top=int(p["top"])))
    return 0


def _run(overrides: Sequence[str]) -> int:
    from harness.cli.render import record_json, record_table
    from harness.runner.fake import run_configured
    from harness.specs import spec_id
    from harness.sweep import slurm_task

    cfg = compose(overrides)
    fmt, _ = _output_settings(cfg)
    timeout_s = float(cfg["run"]["timeout_s"])
    if not timeout_s > 0:
        raise ValueError(f"run.timeout_s={timeout_s} must be > 0")
    # Unknown or missing keys are a usage error (one line, exit 2); an impossible layout is a record.
    spec = run_spec(cfg)
    # Under `srun --nodes=N` (or several tasks of one node) each task forks its block of the ranks,
    # sharing a directory under results_dir; task 0 prints the record, the others print nothing.
    task = slurm_task(str(cfg["results_dir"]), spec_id(spec))
    record = run_configured(spec, cfg["run"], task=task)  # run.mode: real or fake
    if record is None:
        return 0
    print(record_json(record) if fmt == "json" else record_table(record))
    return 0  # every recorded outcome, including oom/timeout/crash/invalid, is a success of the command


def _sweep(overrides: Sequence[str]) -> int:
    from harness.cli.sweep import sweep

    return sweep(overrides)


def _results(args: Sequence[str]) -> int:
    """`harness results status|compact [results_dir=DIR]`."""
    from harness.store import compact, load_results, status_counts
    from harness.sweep import leftover_points, what_is_left

    action = args[0] if args and "=" not in args[0] else "status"
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = set(opts) - {"results_dir"}
    if unknown or action not in ("status", "compact"):
        raise ValueError(f"usage: harness results status|compact [results_dir=DIR] (got {list(args)})")
    root = opts.get("results_dir", "results")
    if action == "compact":
        path, n, bad = compact(root)
        print(f"{n} runs → {path}")
    else:
        frame, bad = load_results(root)
        counts = status_counts(frame)
        print(
            f"{root}: {len(frame)} runs: "
            + (", ".join(f"{s} {n}" for s, n in counts.most_common()) or "none")
        )
        for line in (what_is_left(root), leftover_points(root)):
            if line:
                print(line)
    for line in bad:
        print(f"unreadable: {line}", file=sys.stderr)
    return 0


def _calibrate(overrides: Sequence[str]) -> int:
    from harness.calibrate import evaluate, profile_of, save_profile
    from harness.cli.render import calibration_table

    cfg = compose(overrides)
    fmt, _ = _output_settings(cfg)
    root = str(cfg["results_dir"])
    frame = _load(root)
    ev = evaluate(frame, engine=engine_name(cfg), group_by=str(cfg["calibrate"]["group_by"]))
    path = save_profile(
        profile_of(ev, results_dir=root), cfg["calibrate"]["profile"] or f"{root}/calibration.json"
    )
    if fmt == "json":
        print(json.dumps({"estimators": ev.metrics, "profile": str(path)}, indent=2))
    else:
        print(calibration_table(ev, profile_path=str(path)))
    return 0


def _report(overrides: Sequence[str]) -> int:
    from harness.report import write_report

    cfg = compose(overrides)
    root = str(cfg["results_dir"])
    frame = _load(root)
    path = write_report(
        frame,
        out_dir=cfg["report"]["out"] or root,
        results_dir=root,
        engine=engine_name(cfg),
        group_by=str(cfg["calibrate"]["group_by"]),
    )
    print(f"report: {path}")
    return 0


def _load(root: str):
    """The runs of ``root`` (unreadable files named on stderr); a missing or empty directory is an error."""
    from pathlib import Path

    from harness.store import load_results

    if not Path(root).is_dir():
        raise ValueError(f"results_dir={root} is not a directory")
    frame, bad = load_results(root)
    for line in bad:
        print(f"unreadable: {line}", file=sys.stderr)
    if frame.empty:
        raise ValueError(f"results_dir={root} holds no runs")
    return frame


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "estimate": _estimate,
    "plan": _plan,
    "run": _run,
    "sweep": _sweep,
    "results": _results,
    "calibrate": _calibrate,
    "report": _report,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        print(__version__)
        return 0
    command, overrides = args[0], args[1:]
    if command not in COMMANDS:
        print(f"harness: unknown command {command!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    bad = [o for o in overrides if "=" not in o and not (command == "results" and o == overrides[0])]
    if bad:
        print(f"harness {command}: error: override {bad[0]!r} is not key=value", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](overrides)
    except BrokenPipeError:
        # `harness plan ... | head`: the reader left; say nothing more.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush quiet
        return 0
    except (ConfigError, InvalidSpec, ValueError) as exc:  # CalibrationError is a ValueError
        # Bad input is one line that says what is wrong, never a traceback.
        print(f"harness {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
