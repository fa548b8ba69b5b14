"""`harness <command> [key=value ...]`: dispatch, one-line errors, exit codes."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence

from harness import __version__
from harness.cli.config import ConfigError, compose, engine_name, gpu_scale_defaults, run_spec
from harness.cli.results import load_runs, report_command, results_command, writable_target
from harness.runner.procs import Terminated
from harness.spec import InvalidSpec
from harness.spec.validate import MAX_RANKS


def _output_settings(cfg: dict) -> tuple[str, float]:
    """``format`` and ``threshold``, checked; ``threshold=profile`` is the calibration profile's
    learned safe threshold."""
    fmt = cfg["format"]
    if fmt not in ("table", "json"):
        raise ValueError(f"format={fmt!r} must be table or json")
    if cfg["threshold"] == "profile":
        profile = _profile(cfg)
        if profile is None:
            raise ValueError("threshold=profile needs calibration=PATH (the profile whose threshold to use)")
        if profile.safe_threshold is None:
            raise ValueError(
                f"threshold=profile: {profile.path} learned no safe threshold (no run of its fit ran out "
                "of memory); give threshold=<ratio>"
            )
        device = str((cfg.get("device") or {}).get("name"))
        kinds = profile.fitted_on.get("device_kinds") or []
        if kinds and device not in kinds:
            # A threshold learned on one kind of device says nothing of another's margin (issue 31).
            raise ValueError(
                f"threshold=profile: {profile.path} learned its threshold on {', '.join(kinds)}, not on "
                f"{device}; give threshold=<ratio> (e.g. 0.8)"
            )
        if profile.safe_threshold > 1:
            # Never a verdict above the card: a learned threshold over 100 % is the card's capacity.
            _warn_once(
                f"note: {profile.path}'s safe threshold {profile.safe_threshold:.1%} is above the card's "
                "capacity; judged against 100%"
            )
        return fmt, min(1.0, profile.safe_threshold)
    try:
        threshold = float(cfg["threshold"])
    except (TypeError, ValueError):
        raise ValueError(f"threshold={cfg['threshold']!r} must be a ratio in (0, 1], e.g. 0.8") from None
    if not 0 < threshold <= 1:
        hint = f"; did you mean {threshold / 100:g}?" if 1 < threshold <= 100 else ""
        raise ValueError(
            f"threshold={cfg['threshold']} must be a ratio of the device's memory in (0, 1] "
            f"(0.8 = 80 %){hint}"
        )
    return fmt, threshold


def _estimate(overrides: Sequence[str]) -> int:
    from harness.cli.render.common import JSON_UNITS, with_stack
    from harness.cli.render.estimate import estimate_table
    from harness.estimate import estimate

    cfg = _compose_scaled(overrides)
    fmt, threshold = _output_settings(cfg)
    est = estimate(run_spec(cfg), engine=engine_name(cfg))
    profile = _profile(cfg)
    calibrated = profile.total_bytes(est) if profile else None
    stack = _stack(cfg)
    if fmt == "json":
        record = est.as_record(threshold=threshold)
        record["stack"] = stack.as_record()
        if profile:
            from harness.estimate.levels import verdict_bytes

            device = verdict_bytes(est, profile)
            record.update(
                calibration=profile.path,
                calibrated_total_bytes=calibrated,
                calibrated_utilisation=calibrated / est.capacity_bytes,
                calibrated_reserved_total_bytes=profile.reserved_bytes(est),
                calibrated_device_total_bytes=device,
                fits=device / est.capacity_bytes <= threshold,
            )
        record["units"] = JSON_UNITS
        print(json.dumps(record, indent=2))
    else:
        table = estimate_table(
            est,
            threshold=threshold,
            calibrated_bytes=calibrated,
            profile=profile,
            explain=bool(cfg.get("explain")),
        )
        print(with_stack(table, stack))
    return 0


def _stack(cfg: dict):
    """The stack a composed config assumed (harness.spec.stacks), for the output's stack line / field."""
    from harness.spec import apply_stack

    return apply_stack(cfg)[1]


def _compose_scaled(overrides: Sequence[str]) -> dict:
    """The config of ``estimate``, ``plan`` and ``run`` (and ``sweep`` without a study): the published
    study's device and training shape for a GPU-scale model unless named, said in one line on stderr
    once the config composes, so that the same overrides are the same configuration in every command."""
    overrides, note = gpu_scale_defaults(overrides)
    cfg = compose(overrides)
    if note:
        print(note, file=sys.stderr)
    return cfg


def _profile(cfg: dict):
    """The calibration profile named by ``calibration=`` (None when unset)."""
    if not cfg.get("calibration"):
        return None
    from harness.analysis.profile import load_profile  # no scikit-learn: applying a profile is arithmetic

    profile = load_profile(cfg["calibration"])
    warning = profile.outside(run_spec(cfg))
    if warning:
        _warn_once(f"harness: warning: {warning}")
    return profile


@functools.cache
def _warn_once(line: str) -> None:
    """(threshold=profile loads the profile a second time: one warning still)"""
    print(line, file=sys.stderr)


def _step_time(cfg: dict):
    """The step-time model of the profile named by ``calibration=`` (None when unset or it has none)."""
    if not cfg.get("calibration"):
        return None
    from harness.analysis.steptime import load_step_time

    return load_step_time(cfg["calibration"])


def _plan(overrides: Sequence[str]) -> int:
    from harness.cli.render.common import with_stack
    from harness.cli.render.plan import plan_json, plan_table
    from harness.estimate.plan import PlanOptions, plan

    cfg = _compose_scaled(overrides)
    fmt, threshold = _output_settings(cfg)
    p = cfg["plan"]
    opts = PlanOptions(
        gpus=_whole(p["gpus"], "plan.gpus", MAX_RANKS),
        global_batch_size=p["global_batch_size"],
        micro_batch_sizes=tuple(p["micro_batch_sizes"]),
        zero_stages=tuple(p["zero_stages"]),
        recompute=tuple(p["recompute"]),
        pp_schedules=tuple(p["pp_schedules"]),
        virtual_stages=tuple(p["virtual_stages"]),
        max_tp=_whole(p["max_tp"], "plan.max_tp", MAX_RANKS),
        threshold=threshold,
        engine=engine_name(cfg),
        calibration=_profile(cfg),
        step_time=_step_time(cfg),
    )
    _whole(p["top"], "plan.top", 10**9)  # rows printed
    if p.get("emit"):  # a path Hydra could not find as a study fails before the work, not after
        from harness.cli.config import config_dir
        from harness.cli.emit import study_target

        study_target(p["emit"], config_dir())
    if p.get("solve") is not None:
        return _plan_solve(cfg, opts, fmt)
    result = plan(run_spec(cfg), opts)
    if fmt == "json":
        print(json.dumps({"stack": _stack(cfg).as_record(), **plan_json(result, opts)}, indent=2))
    else:
        print(
            with_stack(
                plan_table(result, opts, top=int(p["top"]), explain=bool(cfg.get("explain"))), _stack(cfg)
            )
        )
    _emit(cfg, [r.estimate.spec for r in result.fitting[: int(p["top"])]], fmt, opts)
    return 0


def _whole(value, key: str, most: int) -> int:
    """A count given on the command line: a whole number from 1 to ``most`` (issue 29: plan.gpus=1.5
    was silently 1, plan.max_gpus=10**12 ran out of memory)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value != int(value)
    ):
        raise ValueError(f"{key}={value!r} must be a whole number")
    if not 1 <= value <= most:
        raise ValueError(f"{key}={value!r} must be from 1 to {most:,}")
    return int(value)


def _plan_solve(cfg: dict, opts, fmt: str) -> int:
    """``plan.solve=min_gpus|max_micro_batch|max_seq_len``: a reverse question (harness.estimate.solve)."""
    from harness.cli.render.plan import solve_json, solve_table
    from harness.estimate import solve as sv

    p, question, base = cfg["plan"], cfg["plan"]["solve"], run_spec(cfg)
    if question == "min_gpus":
        solution = sv.min_gpus(base, opts, max_gpus=_whole(p["max_gpus"], "plan.max_gpus", MAX_RANKS))
    elif question == "max_micro_batch":
        solution = sv.max_micro_batch(base, opts)
    elif question == "max_seq_len":
        solution = sv.max_seq_len(base, opts)
    else:
        raise ValueError(f"plan.solve={question!r} must be null or one of {', '.join(sv.QUESTIONS)}")
    top = int(p["top"])
    if fmt == "json":
        print(json.dumps({"stack": _stack(cfg).as_record(), **solve_json(solution, opts)}, indent=2))
    else:
        from harness.cli.render.common import with_stack

        print(with_stack(solve_table(solution, opts, top=top, explain=bool(cfg.get("explain"))), _stack(cfg)))
    if solution.plan is not None:
        specs = [r.estimate.spec for r in solution.plan.fitting[:top]]
    else:
        specs = [] if solution.best is None else [solution.best.estimate.spec]
    _emit(cfg, specs, fmt, opts)
    return 0


def _emit(cfg: dict, specs: list, fmt: str, opts) -> None:
    """``plan.emit=DIR/study/NAME.yaml``: the layouts as a study for ``harness sweep``, and the command."""
    path = cfg["plan"].get("emit")
    if not path:
        return
    from harness.cli.config import config_dir
    from harness.cli.emit import write_study

    how = ""
    if specs:
        first = specs[0]
        how = (
            f"{first.model.name} on {first.parallel.world} × {first.device.name}, engine {opts.engine}, "
            f"threshold {opts.threshold:g}"
        )
    target, command = write_study(path, specs, how=how, config_dir=config_dir())
    out = sys.stderr if fmt == "json" else sys.stdout
    print(f"study: {target} ({len(specs)} layouts); measure them: {command}", file=out)


def _run(overrides: Sequence[str]) -> int:
    from harness.cli.render.run import record_json, record_table
    from harness.runner.fake.run import run_configured
    from harness.spec import spec_id
    from harness.sweep.launch import run_artifacts, run_timeout, slurm_task

    cfg = _compose_scaled(overrides)  # the same configuration as estimate and plan of these overrides
    from harness.spec.stacks import require_runnable

    require_runnable(cfg, "run")
    fmt, threshold = _output_settings(cfg)
    fail_on = fail_statuses(cfg["run"].get("fail_on"))
    run_timeout(cfg)  # run.timeout_s checked here (inf, <= 0: one line, exit 2); run_configured reads it
    # Unknown or missing keys are a usage error (one line, exit 2); an impossible layout is a record.
    spec = run_spec(cfg)
    _refuse_beyond_reach(spec, cfg)
    # Under `srun --nodes=N` (or several tasks of one node) each task forks its block of the ranks,
    # sharing a directory under results_dir; task 0 prints the record, the others print nothing.
    task = slurm_task(str(cfg["results_dir"]), spec_id(spec))
    record = run_configured(spec, cfg["run"], task=task, artifacts=run_artifacts(cfg))  # real or fake
    if record is None:
        return 0
    stack = _stack(cfg)
    if fmt == "json":
        print(record_json({**record, "stack": stack.as_record()}))
    else:
        from harness.cli.render.common import with_stack

        print(with_stack(record_table(record, threshold=threshold), stack))
    # Every recorded outcome, including oom/timeout/crash/invalid, is a success of the command, unless
    # run.fail_on lists it (a CI script that needs a failing exit code).
    return 1 if record["status"] in fail_on else 0


def _refuse_beyond_reach(spec, cfg: dict) -> None:
    """A real run the sweep would never launch (its estimate many times the device, or on the CPU its
    ranks beyond the host's RAM) is refused up front, with the estimate and the way to see it anyway
    (issue 31: `run` of a paper-scale model on the CPU waited out its timeout)."""
    if str(cfg["run"].get("mode", "real")) != "real":
        return
    from harness.estimate import estimate
    from harness.spec import canonical
    from harness.sweep.launch import beyond_reach

    try:
        est = estimate(canonical(spec))
    except InvalidSpec:
        return  # the run records it as invalid, with the reason
    reason = beyond_reach(spec, est, cfg)
    if reason:
        raise ValueError(f"not run: {reason}; run.mode=fake traces it without the memory")


def fail_statuses(value) -> frozenset[str]:
    """``run.fail_on``: null, a status, ``oom,crash`` or a list; each a recorded status."""
    from harness.runner.record import STATUSES

    if value is None:
        return frozenset()
    items = value if isinstance(value, list) else str(value).split(",")
    statuses = frozenset(str(s).strip() for s in items if str(s).strip())
    wrong = sorted(statuses - set(STATUSES))
    if wrong:
        raise ValueError(
            f"run.fail_on={','.join(map(str, items))}: {', '.join(wrong)} not among {', '.join(STATUSES)}"
        )
    return statuses


def _sweep(overrides: Sequence[str]) -> int:
    from harness.cli.sweep import sweep

    return sweep(overrides)


def _calibrate(overrides: Sequence[str]) -> int:
    from harness.analysis.calibrate import evaluate, profile_of, save_profile
    from harness.analysis.steptime import evaluate_step_time, step_time_section
    from harness.cli.render.calibrate import calibration_table, step_time_table

    cfg = compose(overrides)
    fmt, _ = _output_settings(cfg)
    root = str(cfg["results_dir"])
    target = str(cfg["calibrate"]["profile"] or f"{root}/calibration.json")
    writable_target(target, "calibrate.profile", directory=False)
    frame = load_runs(root)
    group_by = str(cfg["calibrate"]["group_by"])
    ev = evaluate(frame, engine=engine_name(cfg), group_by=group_by)
    st = evaluate_step_time(frame, group_by=group_by)  # None: too few timed runs
    profile = profile_of(ev, results_dir=root)
    if st is not None:
        profile["step_time"] = step_time_section(st)
    path = save_profile(profile, target)
    if fmt == "json":
        out = {"estimators": ev.metrics, "fragmentation": ev.fragmentation, "profile": str(path)}
        if st is not None:
            keys = ("median_ape", "spearman_median", "top1_ratio_median")
            out["throughput"] = {k: st.metrics[k] for k in keys}
        print(json.dumps(out, indent=2))
    else:
        print(calibration_table(ev, profile_path=str(path)))
        if st is not None:
            print("\n" + step_time_table(st))
    return 0


def _replay(overrides: Sequence[str]) -> int:
    from harness.cli.replay import replay_command

    return replay_command(overrides)


def _help(command: str, args: Sequence[str]) -> int:
    """``harness COMMAND --help`` (or ``-h``): its help under the given overrides; ``--cfg job``: the
    composed config as YAML (Hydra's spelling)."""
    from harness.cli.config import groups
    from harness.cli.help import command_help

    overrides = [a for a in args if a not in ("-h", "--help", "--cfg", "job", "all")]
    try:
        if command in ("estimate", "plan"):
            cfg = _compose_scaled(overrides)
        else:
            cfg = compose(overrides) if command != "results" else None
    except ConfigError as exc:
        print(f"harness {command}: error: {exc}", file=sys.stderr)
        return 2
    if "--cfg" in args and cfg is not None:
        import yaml

        print(yaml.safe_dump(cfg, sort_keys=False), end="")
    else:
        print(command_help(command, cfg, groups()))
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "estimate": _estimate,
    "plan": _plan,
    "run": _run,
    "sweep": _sweep,
    "results": results_command,
    "calibrate": _calibrate,
    "report": report_command,
    "replay": _replay,
}


def main(argv: Sequence[str] | None = None) -> int:
    from harness.cli.help import COMMAND_HELP, usage

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(list(COMMAND_HELP), __version__))
        return 0 if args else 2
    if args[0] == "--version":
        print(__version__)
        return 0
    command, overrides = args[0], args[1:]
    wants_help = command in COMMAND_HELP and bool({"-h", "--help", "--cfg"} & set(overrides))
    if command not in COMMANDS and not wants_help:
        print(f"harness: unknown command {command!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    bad = [o for o in overrides if "=" not in o and not (command == "results" and o == overrides[0])]
    if bad and not wants_help:
        print(f"harness {command}: error: override {bad[0]!r} is not key=value", file=sys.stderr)
        return 2
    try:
        return _help(command, overrides) if wants_help else COMMANDS[command](overrides)
    except BrokenPipeError:
        # `harness plan ... | head`: the reader left; say nothing more.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush quiet
        return 0
    except (ConfigError, InvalidSpec, ValueError) as exc:  # CalibrationError is a ValueError
        # Bad input is one line that says what is wrong, never a traceback.
        print(f"harness {command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full, read-only or vanished disk: the file and the reason, in one line
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"harness {command}: error: cannot write or read{where}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    except KeyboardInterrupt:  # Ctrl-C (issue 29: 63 lines of traceback); the ranks were reaped
        print(
            f"harness {command}: interrupted (Ctrl-C); nothing was written for the work in progress"
            + (": run the sweep again to resume" if command == "sweep" else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    except Terminated as exc:  # SIGTERM mid-point: its ranks are reaped and it has no row
        print(
            f"harness {command}: terminated ({exc}); no row was written for the point in progress"
            + (": run the sweep again to resume" if command == "sweep" else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    raise SystemExit(main())
