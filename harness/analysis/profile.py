"""Calibration profiles: load one, check every field, and apply it to an estimate, with plain Python.

A profile is coefficients (harness.analysis.calibrate fits them with scikit-learn); applying it needs no fit,
so this module imports neither scikit-learn nor numpy (issue 12: ``estimate calibration=...`` spent
2.6 s importing scikit-learn). Every field it knows is checked (type, finite, a sane range) with a
one-line error; sections and keys it does not know (a newer fit's) are accepted when they are well
formed JSON. A profile records what it was fitted on (device kinds, precisions, engine, the models'
parameter counts, torch versions): applying it outside that prints a one-line warning (issue 16).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import __version__
from harness.estimate import TERMS, levels
from harness.estimate.core import Estimate
from harness.estimate.params import total_params
from harness.estimate.steptime import ADDED_TERMS as ADDED_STEP_TIME_TERMS
from harness.estimate.steptime import TERMS as STEP_TIME_TERMS
from harness.estimate.steptime import StepTimeModel
from harness.estimate.terms import STATE_TERMS, STEP_TERMS
from harness.spec import RunSpec

PROFILE_FORMAT = "harness-calibration"
PROFILE_VERSION = 1
ENGINES_COMPARED = ("paper", "megatron", "torch")
MAX_COEFFICIENT = 100.0  # a term counted 100 times over is no correction: a broken fit or file
MAX_BYTES = 2**50  # 1 PiB: no device's constant overhead comes near
MAX_FRAGMENTATION = 10.0  # reserved - allocated per byte of the allocated peak (or of its parts)


class CalibrationError(ValueError):
    """A profile that cannot be used here, or data a fit cannot be made from; the message says why."""


_FWD = tuple(k for k in TERMS if k not in STATE_TERMS and k not in STEP_TERMS)
_FWD_SET, _STEP_SET = frozenset(_FWD), frozenset(STEP_TERMS)


def peak_terms(terms: dict[str, int]) -> dict[str, int]:
    """The terms that make up the estimator's peak: states plus the larger of the forward/backward
    branch and the optimizer-step branch (core.peak_bytes); the other branch is zeroed, so that the
    terms sum to the estimate and a coefficient scales only what is in the peak."""
    return dict(zip(TERMS, _peak_values(terms), strict=True))


def _peak_values(terms: dict[str, int]) -> list[int]:
    """:func:`peak_terms`'s values in TERMS order."""
    get = terms.__getitem__
    step_wins = sum(map(get, STEP_TERMS)) > sum(map(get, _FWD))
    drop = _FWD_SET if step_wins else _STEP_SET
    return [0 if k in drop else int(terms[k]) for k in TERMS]


def torch_version() -> str | None:
    """The installed torch's version, without importing torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def fitted_on(specs: list[RunSpec], torch_versions: list[str]) -> dict[str, Any]:
    """What a fit saw, for :meth:`Profile.outside`: device kinds, precisions, the models' parameter
    counts (min, max) and torch versions."""
    params = [total_params(s.model) for s in specs]
    return {
        "device_kinds": sorted({s.device.name for s in specs}),
        "precisions": sorted({s.train.precision for s in specs}),
        "model_params": [min(params), max(params)] if params else None,
        "torch_versions": sorted({str(v) for v in torch_versions if v}),
    }


@dataclass(frozen=True)
class Profile:
    """A loaded, checked calibration profile."""

    path: str
    engine: str
    coefficients: dict[str, float]
    constant_bytes: float
    fragmentation: dict[str, float] | None
    summary: str
    fitted_on: dict[str, Any] = field(default_factory=dict)
    safe_threshold: float | None = None  # the calibrated estimator's learned safe utilisation
    extra: dict[str, Any] = field(default_factory=dict)  # sections this harness does not know

    def stage_bytes(self, terms: dict[str, int]) -> float:
        """The calibrated allocated level of one stage."""
        return sum(map(operator.mul, self._vectors[0], _peak_values(terms))) + self.constant_bytes

    @functools.cached_property
    def _vectors(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The coefficients in TERMS order, and the same with only the states' (``plan`` applies a
        profile to every stage of tens of thousands of candidates)."""
        every = tuple(self.coefficients.get(k, 0.0) for k in TERMS)
        return every, tuple(c if k in STATE_TERMS else 0.0 for k, c in zip(TERMS, every, strict=True))

    def stage_reserved_bytes(self, terms: dict[str, int], mechanism: float = 0.0) -> float | None:
        """The calibrated reserved level of one stage: allocated plus the fitted fragmentation
        (harness/analysis/fragmentation.py), over the estimate's ``mechanism`` terms where the fit was
        made over them (``over_mechanism``); None when the profile has no fragmentation fit."""
        base = self._stage_reserved_base(terms)
        if base is None:
            return None
        return base + (mechanism if self.fragmentation.get("over_mechanism") else 0.0)

    def _stage_reserved_base(self, terms: dict[str, int]) -> float | None:
        """:meth:`stage_reserved_bytes` without the mechanism terms."""
        f = self.fragmentation
        if not f:
            return None
        values = _peak_values(terms)
        every, states_only = self._vectors
        alloc = sum(map(operator.mul, every, values)) + self.constant_bytes
        if "per_transient_byte" not in f:  # the earlier form: a share of the allocated peak
            return alloc + alloc * f["per_allocated_byte"] + f["constant_bytes"]
        states = sum(map(operator.mul, states_only, values))
        transient = alloc - states
        return (
            alloc + f["per_transient_byte"] * transient + f["per_state_byte"] * states + f["constant_bytes"]
        )

    def reserved_bytes(self, est: Estimate) -> int | None:
        """The calibrated reserved peak: the fitted fragmentation over every stage, then the max (None
        without a fragmentation fit)."""
        if not self.fragmentation:
            return None
        base = {s.stage: self._stage_reserved_base(s.terms) for s in est.stages}
        if not self.fragmentation.get("over_mechanism"):
            return round(max(base.values()))
        _, value = levels.worst_by_bound(
            est.stages,
            lambda s: base[s.stage] + est.reserved_terms_bound(s),
            lambda s: base[s.stage] + levels.mechanism_bytes(est, s),
        )
        return round(value)

    def total_bytes(self, est: Estimate) -> int:
        """The calibrated peak of a configuration: the profile applied to every stage, then the max."""
        if est.engine != self.engine:
            raise CalibrationError(
                f"calibration {self.path} was fitted on engine={self.engine}; this estimate uses "
                f"engine={est.engine} (set engine={self.engine})"
            )
        return round(max(self.stage_bytes(s.terms) for s in est.stages))

    def outside(self, spec: RunSpec) -> str | None:
        """A one-line warning when ``spec`` lies outside what the profile was fitted on (a CPU FP32 fit
        of small models applied to a 70B BF16 estimate on an H100); None inside, or when the profile
        does not say (profiles written before it recorded this)."""
        seen, off = self.fitted_on, []
        kinds, precisions = seen.get("device_kinds"), seen.get("precisions")
        if kinds and spec.device.name not in kinds:
            off.append(f"device {spec.device.name} (fitted on {', '.join(kinds)})")
        if precisions and spec.train.precision not in precisions:
            off.append(f"precision {spec.train.precision} (fitted on {', '.join(precisions)})")
        size = seen.get("model_params")
        n = total_params(spec.model)
        if size and not size[0] <= n <= size[1]:
            off.append(f"{_count(n)} parameters (fitted on {_count(size[0])}–{_count(size[1])})")
        versions, mine = seen.get("torch_versions"), torch_version()
        if versions and mine and _minor(mine) not in {_minor(v) for v in versions}:
            off.append(f"torch {mine} (fitted on {', '.join(versions)})")
        if not off:
            return None
        return f"calibration {self.path} is applied outside what it was fitted on: {'; '.join(off)}"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g}"


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


# ------------------------------------------------------------------------------------------ checking


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _number(path, name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalibrationError(f"calibration profile {path}: {name} = {value!r} must be a number")
    if not (math.isfinite(value) and low <= value <= high):
        raise CalibrationError(
            f"calibration profile {path}: {name} = {value!r} must be a finite number in [{low:g}, {high:g}]"
        )
    return float(value)


def _kind(path, name: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise CalibrationError(f"calibration profile {path}: {name} = {value!r:.80} must be {what}")
    return value


def _strings(path, name: str, value: Any) -> list[str]:
    _kind(path, name, value, list, "a list of strings")
    if not all(isinstance(v, str) for v in value):
        raise CalibrationError(f"calibration profile {path}: {name} must be a list of strings")
    return value


def _fitted_on(path, data: Any) -> dict[str, Any]:
    data = _kind(path, "fitted_on", data, dict, "an object")
    for key in ("device_kinds", "precisions", "torch_versions", "config_ids"):
        if data.get(key) is not None:
            _strings(path, f"fitted_on.{key}", data[key])
    if data.get("count") is not None:
        _number(path, "fitted_on.count", data["count"], 0, 1e12)
    size = data.get("model_params")
    if size is not None:
        if not (isinstance(size, list) and len(size) == 2):
            raise CalibrationError(f"calibration profile {path}: fitted_on.model_params must be [min, max]")
        low = _number(path, "fitted_on.model_params[0]", size[0], 0, 1e15)
        high = _number(path, "fitted_on.model_params[1]", size[1], low, 1e15)
        data = {**data, "model_params": [low, high]}
    return data


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile: its format, version and feature names must be this harness's, and
    every value it knows must be of the right type, finite and in a sane range."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise CalibrationError(f"calibration profile {path} does not exist") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, NaN/Infinity, not UTF-8
        raise CalibrationError(f"calibration profile {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise CalibrationError(f"{path} is not a harness calibration profile (format != {PROFILE_FORMAT!r})")
    if data.get("version") != PROFILE_VERSION:
        raise CalibrationError(
            f"calibration profile {path} has version {data.get('version')}; this harness ({__version__}) "
            f"reads version {PROFILE_VERSION}: refit it with harness calibrate"
        )
    coefs = _kind(path, "coefficients", data.get("coefficients") or {}, dict, "an object")
    features = _strings(path, "features", data.get("features", []))
    unknown = sorted(set(coefs) - set(TERMS))
    missing = sorted(set(TERMS) - set(coefs))
    if unknown or missing or list(features) != list(coefs):
        raise CalibrationError(
            f"calibration profile {path} was fitted on other feature names (unknown here: {unknown or 'none'}"
            f"; missing: {missing or 'none'}): the estimator's terms changed, refit it with harness calibrate"
        )
    if data.get("engine") not in ENGINES_COMPARED:
        raise CalibrationError(f"calibration profile {path} names an unknown engine {data.get('engine')!r}")
    bad = [
        k
        for k, v in coefs.items()
        if isinstance(v, bool) or not (isinstance(v, int | float) and math.isfinite(v) and v >= 0)
    ]
    if bad:
        raise CalibrationError(
            f"calibration profile {path}: coefficients of {bad} are not finite numbers >= 0"
        )
    coefficients = {k: _number(path, f"coefficients.{k}", v, 0.0, MAX_COEFFICIENT) for k, v in coefs.items()}
    constant = _number(path, "constant_bytes", data.get("constant_bytes", 0), 0.0, MAX_BYTES)
    frag = data.get("fragmentation")
    if frag is not None:
        _kind(path, "fragmentation", frag, dict, "an object (or null)")
        # Two forms: reserved - allocated ~ a x transient + b x states + c (analysis/fragmentation.py),
        # or the earlier a x allocated + c.
        shares = (
            ("per_transient_byte", "per_state_byte")
            if "per_transient_byte" in frag
            else ("per_allocated_byte",)
        )
        if not isinstance(frag.get("over_mechanism", False), bool):
            raise CalibrationError(
                f"calibration profile {path}: fragmentation.over_mechanism must be true or false"
            )
        frag = {
            **frag,
            **{k: _number(path, f"fragmentation.{k}", frag.get(k), 0.0, MAX_FRAGMENTATION) for k in shares},
            "constant_bytes": _number(
                path, "fragmentation.constant_bytes", frag.get("constant_bytes"), 0.0, MAX_BYTES
            ),
        }
    for key in ("summary", "harness_version", "target"):
        if data.get(key) is not None:
            _kind(path, key, data[key], str, "text")
    if data.get("unfitted") is not None:
        unfitted = _strings(path, "unfitted", data["unfitted"])
        if set(unfitted) - set(TERMS):
            raise CalibrationError(f"calibration profile {path}: unfitted names unknown terms")
    for key in ("cross_validation", "metrics"):
        if data.get(key) is not None:
            _kind(path, key, data[key], dict, "an object")
    safe = ((data.get("metrics") or {}).get("calibrated") or {}).get("safe_threshold")
    if safe is not None:
        safe = _number(path, "metrics.calibrated.safe_threshold", safe, 1e-6, 100.0)
    known = {
        "format", "version", "harness_version", "engine", "target", "features", "coefficients",
        "unfitted", "constant_bytes", "fragmentation", "summary", "fitted_on", "cross_validation",
        "metrics",
    }  # fmt: skip
    return Profile(
        path=str(path),
        engine=data["engine"],
        coefficients=coefficients,
        constant_bytes=constant,
        fragmentation=frag,
        summary=str(data.get("summary", "")),
        fitted_on=_fitted_on(path, data.get("fitted_on") or {}),
        safe_threshold=safe,
        extra={k: v for k, v in data.items() if k not in known},
    )


def load_step_time(path: str | Path) -> StepTimeModel | None:
    """The ``step_time`` section of a calibration profile as a model, None when it has none (a profile
    fitted before issue 17, or on runs without step times)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"calibration profile {path} is not readable JSON: {exc}") from None
    section = data.get("step_time") if isinstance(data, dict) else None
    if not section:
        return None
    where = f"calibration profile {path}: step_time"
    if not isinstance(section, dict):
        raise CalibrationError(f"{where} is not an object: refit it with harness calibrate")
    # Every field checked here (issue 29: a constant_s of -1e30 ranked layouts at -1e30 s, and other
    # malformed fields were tracebacks).
    constant = section.get("constant_s")
    if (
        isinstance(constant, bool)
        or not isinstance(constant, int | float)
        or not math.isfinite(constant)
        or constant < 0
    ):
        raise CalibrationError(f"{where}.constant_s={constant!r} must be a finite number of seconds >= 0")
    if not isinstance(section.get("device"), str):
        raise CalibrationError(f"{where}.device={section.get('device')!r} must be a device preset's name")
    cores = section.get("cpu_cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise CalibrationError(f"{where}.cpu_cores={cores!r} must be a whole number >= 1 (or null)")
    for key in ("unfitted", "precisions"):
        value = section.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise CalibrationError(f"{where}.{key}={value!r} must be a list of names")
    coefs = section.get("coefficients") or {}
    if not isinstance(coefs, dict):
        raise CalibrationError(f"{where}.coefficients must be an object of term: seconds per unit")
    # A term added since the fit (ADDED_STEP_TIME_TERMS: expert parallelism's) is one no fitted run
    # exercised: unfitted, coefficient 0, and said so (StepTimeModel.describe), as a refit would make it.
    added = tuple(k for k in ADDED_STEP_TIME_TERMS if k not in coefs)
    changed = sorted(set(coefs) ^ (set(STEP_TIME_TERMS) - set(added)))  # renamed, removed, missing
    bad = [k for k, v in coefs.items() if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0)]
    if changed or bad:
        raise CalibrationError(
            f"calibration profile {path}: step_time terms {changed or bad} are not this harness's "
            "or not finite numbers >= 0: refit it with harness calibrate"
        )
    cores = section.get("cpu_cores")
    return StepTimeModel(
        {k: float(coefs.get(k, 0.0)) for k in STEP_TIME_TERMS},
        float(section["constant_s"]),
        str(section["device"]),
        int(cores) if cores else None,
        tuple(section.get("unfitted") or ()) + added,
        tuple(section.get("precisions") or ()),
    )
