"""What several commands share: output settings, the GPU-scale defaults, the stack, the profile."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from harness.cli.config import compose, gpu_scale_defaults, run_spec


def output_settings(cfg: dict) -> tuple[str, float]:
    """``format`` and ``threshold``, checked; ``threshold=profile`` is the calibration profile's
    learned safe threshold."""
    fmt = cfg["format"]
    if fmt not in ("table", "json"):
        raise ValueError(f"format={fmt!r} must be table or json")
    if cfg["threshold"] == "profile":
        profile = profile_of_config(cfg)
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
            warn_once(
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


def stack_of_config(cfg: dict):
    """The stack a composed config assumed (harness.spec.stacks), for the output's stack line / field."""
    from harness.spec import apply_stack

    return apply_stack(cfg)[1]


def compose_scaled(overrides: Sequence[str]) -> dict:
    """The config of ``estimate``, ``plan`` and ``run`` (and ``sweep`` without a study): the published
    study's device and training shape for a GPU-scale model unless named, said in one line on stderr
    once the config composes, so that the same overrides are the same configuration in every command."""
    overrides, note = gpu_scale_defaults(overrides)
    cfg = compose(overrides)
    if note:
        print(note, file=sys.stderr)
    return cfg


def profile_of_config(cfg: dict):
    """The calibration profile named by ``calibration=`` (None when unset)."""
    if not cfg.get("calibration"):
        return None
    from harness.analysis.profile import load_profile  # no scikit-learn: applying a profile is arithmetic

    profile = load_profile(cfg["calibration"])
    warning = profile.outside(run_spec(cfg))
    if warning:
        warn_once(f"harness: warning: {warning}")
    return profile


@functools.cache
def warn_once(line: str) -> None:
    """(threshold=profile loads the profile a second time: one warning still)"""
    print(line, file=sys.stderr)


def step_time_of_config(cfg: dict):
    """The step-time model of the profile named by ``calibration=`` (None when unset or it has none)."""
    if not cfg.get("calibration"):
        return None
    from harness.analysis.steptime import load_step_time

    return load_step_time(cfg["calibration"])
