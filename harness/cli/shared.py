"""What several commands share: output settings, the GPU-scale defaults, the stack, the profile."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

from harness.cli.config import compose, engine_name, gpu_scale_defaults, run_spec, say


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


def fails_on_nofit(cfg: dict) -> bool:
    """``fail_on=nofit`` (estimate, plan): exit 1 when nothing fits (issue 31); null: exit 0 for any
    answer. Checked before the work."""
    value = cfg.get("fail_on")
    if value is None or value == "":
        return False
    if str(value) != "nofit":
        raise ValueError(f"fail_on={value!r} must be nofit or null")
    return True


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
        say(note)
    return cfg


# The committed profile a GPU preset gets by default (issue 32 items 2 and 4): fitted on the 870
# fake-traced points of the paper's H100 and A100 grids and the extended grid (7B-405B, BF16; every
# recomputation policy, FSDP2, interleaving, context parallelism; A100, H100 and H200 capacities),
# its fragmentation on top of the estimator's mechanism terms, judged held out by layout family and
# by model (docs/studies/paper_fake.md). Fake traces do not depend on the card, so it applies to every
# GPU preset; its learned safe threshold only to the cards it was fitted on (output_settings). Found
# beside the package (a checkout or an editable install); elsewhere there is none, and a note says so.
DEFAULT_GPU_PROFILE = "results/paper_fake/all/calibration.json"
OFF = ("none", "null", "off", "false")


def calibration_of_config(cfg: dict) -> tuple[str | None, bool]:
    """(the profile path ``calibration=`` names, whether it is the GPU presets' default). ``auto``
    (the default): :data:`DEFAULT_GPU_PROFILE` for a GPU device and the ``torch`` engine, nothing on
    the CPU or for another engine; ``none`` turns it off."""
    value = cfg.get("calibration")
    if value is None or value is False or str(value).lower() in OFF:
        return None, False
    if str(value) != "auto":
        return str(value), False
    device = str((cfg.get("device") or {}).get("name"))
    if device == "cpu" or engine_name(cfg) != "torch":
        return None, False
    path = Path(__file__).resolve().parents[2] / DEFAULT_GPU_PROFILE
    if not path.is_file():
        warn_once(f"note: no default calibration for GPU presets ({DEFAULT_GPU_PROFILE} is not installed)")
        return None, False
    return str(path), True


def profile_of_config(cfg: dict):
    """The calibration profile ``calibration=`` names (None when off, or ``auto`` on the CPU)."""
    path, default = calibration_of_config(cfg)
    if path is None:
        return None
    from harness.analysis.profile import load_profile  # no scikit-learn: applying a profile is arithmetic
    from harness.estimate.params import total_params

    profile = load_profile(path)
    if default:
        seen = profile.fitted_on
        low, high = seen.get("model_params") or (0, 0)
        spec = run_spec(cfg)
        n = total_params(spec.model)
        outside = []
        if not low <= n <= high:
            outside.append(f"{n / 1e9:.2f} B parameters")
        if spec.train.precision not in (seen.get("precisions") or [spec.train.precision]):
            outside.append(spec.train.precision)
        if spec.model.moe:  # the paper's grids are dense models
            outside.append("a mixture of experts")
        warn_once(
            f"note: calibration={DEFAULT_GPU_PROFILE} (the default for GPU presets: fitted on "
            f"{seen.get('count')} fake-traced points of the paper's grids, "
            f"{low / 1e9:.1f}-{high / 1e9:.1f} B parameters, BF16; calibration=none turns it off)"
            + (f"; applied outside that: {', '.join(outside)}" if outside else "")
        )
        return dataclasses.replace(profile, path=DEFAULT_GPU_PROFILE)
    warning = profile.outside(run_spec(cfg))
    if warning:
        warn_once(f"harness: warning: {warning}")
    return profile


@functools.cache
def warn_once(line: str) -> None:
    """(threshold=profile loads the profile a second time: one warning still)"""
    say(line)


def step_time_of_config(cfg: dict):
    """The step-time model of the profile ``calibration=`` names (None when off or it has none)."""
    path, _ = calibration_of_config(cfg)
    if path is None:
        return None
    from harness.analysis.profile import load_step_time  # no scikit-learn

    return load_step_time(path)
