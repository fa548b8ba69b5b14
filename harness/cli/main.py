"""`harness <command> [key=value ...]`: dispatch, one-line errors, exit codes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from harness import __version__
from harness.cli.config import ConfigError, compose, engine_name, run_spec
from harness.cli.plan import plan_command
from harness.cli.results import load_runs, report_command, results_command, results_dirs, writable_target
from harness.cli.shared import (
    compose_scaled,
    fails_on_nofit,
    output_settings,
    profile_of_config,
    stack_of_config,
)
from harness.runner.procs import Terminated, _raise_terminated
from harness.spec import InvalidSpec


def _estimate(overrides: Sequence[str]) -> int:
    from harness.cli.render.common import json_envelope, with_stack
    from harness.cli.render.estimate import estimate_table
    from harness.estimate import estimate

    cfg = compose_scaled(overrides)
    fmt, threshold = output_settings(cfg)
    fail_on_nofit = fails_on_nofit(cfg)
    est = estimate(run_spec(cfg), engine=engine_name(cfg))
    profile = profile_of_config(cfg)
    calibrated = profile.total_bytes(est) if profile else None
    stack = stack_of_config(cfg)
    if fmt == "json":
        record = est.as_record(threshold=threshold)
        record["stack"] = stack.as_record()
        # The resolved configuration (issue 28: the same overrides, one spec in every command).
        spec = est.spec
        record["parallel"] = dataclasses.asdict(spec.parallel)
        record["train"] = dataclasses.asdict(spec.train)
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
        print(json.dumps(json_envelope(record), indent=2))
    else:
        table = estimate_table(
            est,
            threshold=threshold,
            calibrated_bytes=calibrated,
            profile=profile,
            explain=bool(cfg.get("explain")),
        )
        print(with_stack(table, stack))
    if fail_on_nofit:
        from harness.estimate.levels import verdict_bytes

        if verdict_bytes(est, profile) > threshold * est.capacity_bytes:
            return 1
    return 0


def _run(overrides: Sequence[str]) -> int:
    from harness.cli.render.run import record_json, record_table
    from harness.runner.fake.run import run_configured
    from harness.spec import spec_id
    from harness.sweep.launch import run_artifacts, run_timeout, slurm_task

    cfg = compose_scaled(overrides)  # the same configuration as estimate and plan of these overrides
    from harness.spec.stacks import require_runnable

    require_runnable(cfg, "run")
    fmt, threshold = output_settings(cfg)
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
    stack = stack_of_config(cfg)
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
    from harness.analysis.reserved import reserved_figures
    from harness.analysis.steptime import evaluate_step_time, step_time_section
    from harness.cli.render.calibrate import calibration_table, step_time_table

    cfg = compose(overrides)
    fmt, _ = output_settings(cfg)
    roots = results_dirs(cfg)
    if len(roots) > 1 and not cfg["calibrate"]["profile"]:
        raise ValueError(
            "calibrate.also_results: name calibrate.profile= (a profile of several directories is not "
            f"{roots[0]}'s own)"
        )
    target = str(cfg["calibrate"]["profile"] or f"{roots[0]}/calibration.json")
    writable_target(target, "calibrate.profile", directory=False)
    frame = load_runs(roots)
    group_by = str(cfg["calibrate"]["group_by"])
    ev = evaluate(frame, engine=engine_name(cfg), group_by=group_by)
    st = evaluate_step_time(frame, group_by=group_by)  # None: too few timed runs
    profile = profile_of(ev, results_dir=" + ".join(roots))
    reserved = reserved_figures(ev)
    if reserved:
        profile["reserved"] = reserved
    if st is not None:
        profile["step_time"] = step_time_section(st)
    path = save_profile(profile, target)
    if fmt == "json":
        out = {
            "estimators": ev.metrics,
            "per_rank": ev.stage_metrics,
            "fragmentation": ev.fragmentation,
            "reserved": reserved,
            "profile": str(path),
        }
        if st is not None:
            keys = ("median_ape", "spearman_median", "top1_ratio_median")
            out["throughput"] = {k: st.metrics[k] for k in keys}
        from harness.cli.render.common import json_envelope

        print(json.dumps(json_envelope(out), indent=2))
    else:
        print(calibration_table(ev, profile_path=str(path), reserved=reserved))
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
            cfg = compose_scaled(overrides)
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
    "plan": plan_command,
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
    # What this command says on stderr, once each, and nothing a command before it in this process said
    # (its JSON's notes; main() runs in-process in tests and tools).
    from harness.cli.config import SAID
    from harness.cli.shared import warn_once

    SAID.clear()
    warn_once.cache_clear()
    # SIGTERM anywhere in a command (issue 29: during a sweep's launch or its closing summary it was
    # silent, exit -15) becomes Terminated: one line, exit 143. The point's supervisor reaps its ranks.
    previous = None
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
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
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
