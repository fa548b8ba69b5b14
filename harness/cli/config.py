"""Compose the sweeps/ config tree with Hydra and convert it, strictly, into frozen specs."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.spec import RunSpec, apply_stack, config_spec


def config_dir() -> Path:
    """The config tree: $HARNESS_CONFIG_DIR, else the copy inside an installed wheel, else sweeps/ of
    the source checkout (editable installs)."""
    env = os.environ.get("HARNESS_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    packaged = Path(__file__).resolve().parents[1] / "_sweeps"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sweeps"


class ConfigError(ValueError):
    """A bad override or config file, with a one-line message."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).split("Config search path")[0]  # the search path names local directories: noise
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("full_key")]
    return " ".join(lines) or type(exc).__name__


def compose(overrides: Sequence[str] = (), *, config_name: str = "config") -> dict[str, Any]:
    """Compose ``config_name`` with Hydra overrides (``model=llama3_8b``, ``parallel.tp=2``) into plain
    dicts. Unknown keys, unknown presets and malformed overrides raise :class:`ConfigError` (a misspelt
    key or preset names the closest known one). ``model.hf_config=PATH`` and ``key=a,b`` for list keys
    are expanded first (:func:`expand`)."""
    overrides = expand(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="harness"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_unknown_name(overrides, config_name) or _one_line(exc)) from None
    finally:
        GlobalHydra.instance().clear()


# Keys whose value is a list: `run.fail_on=oom,crash` means the list, not a sweep over two values.
LIST_KEYS = ("run.fail_on",)
# Keys the CLI reads itself before Hydra composes (so they are in no YAML file).
CLI_KEYS = ("model.hf_config",)


def _key(override: str) -> str:
    """The dotted key of an override, without Hydra's +, ++ or ~ prefix."""
    return override.partition("=")[0].lstrip("+~")


# The notes and warnings this command printed on stderr, for its JSON's ``notes`` (issue 31 item 6:
# they were on stderr only).
SAID: list[str] = []


def say(line: str) -> None:
    """A note or warning for the user: on stderr, and kept for the command's JSON."""
    SAID.append(line)
    print(line, file=sys.stderr)


def expand(overrides: Sequence[str]) -> list[str]:
    """The overrides Hydra composes: ``model.hf_config=PATH`` becomes the ``model.*`` fields it reads
    (in its place, so a later ``model.num_layers=`` still wins); ``run.fail_on=oom,crash`` becomes a
    list; a path (:data:`PATH_KEYS`) is quoted for Hydra where it needs to be."""
    from harness.spec.hf_config import HFConfigError, model_fields

    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model.hf_config":
            if value in ("", "null"):
                continue
            notes: list[str] = []
            try:
                fields = model_fields(value, notes)
            except HFConfigError as exc:
                raise ConfigError(str(exc)) from None
            for note in notes:
                say(f"note: {note}")
            out += [f"model.{k}={_override_value(v)}" for k, v in fields.items()]
        elif key in LIST_KEYS and "," in value and not value.startswith(("[", "'", '"')):
            out.append(f"{key}=[{value}]")
        elif key.lstrip("+~") in PATH_KEYS:
            out.append(quote_path(o))
        else:
            out.append(o)
    return out


# Keys whose values are paths: given as they are (issue 29: a path with a comma, a bracket or a quote
# had to be quoted for Hydra here, and not for `results` or `model.hf_config`, which take it as it is).
PATH_KEYS = (
    "results_dir",
    "calibration",
    "trace",
    "report.out",
    "calibrate.profile",
    "plan.emit",
    "run.fake_cache",
    "hydra.sweep.dir",
    "hydra.run.dir",
)
_HYDRA_SPECIAL = set(" ,[]{}()'\"=:$\\")


def quote_path(override: str) -> str:
    """``KEY=PATH`` for a key of :data:`PATH_KEYS`, its path quoted for Hydra where it needs to be (a
    value already quoted is left as the user wrote it); any other override as it is."""
    key, eq, value = override.partition("=")
    if not eq or key.lstrip("+~") not in PATH_KEYS or not value or value.startswith(("'", '"')):
        return override
    return f"{key}={_hydra_quoted(value)}"


def _hydra_quoted(value: str) -> str:
    """``value`` as a Hydra override reads it verbatim: single-quoted where it holds a character the
    override grammar treats specially (backslash and quote escaped), else as it is."""
    if not _HYDRA_SPECIAL & set(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _override_value(value) -> str:
    """A value as a Hydra override types it: booleans lower case, strings quoted (issue 29: a model
    folder named ``2024`` or ``true`` became an int or a bool)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"'{value}'"  # the name holds only [A-Za-z0-9_.-] (harness.spec.hf_config)
    return str(value)


def _flat_keys(cfg: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def known_keys(config_name: str = "config") -> list[str]:
    """Every dotted key of the default composed config (Hydra's own ``hydra.*`` left out)."""
    cfg = compose((), config_name=config_name)
    return [k for k in _flat_keys(cfg) if not k.startswith("hydra.")] + list(CLI_KEYS)


def groups() -> dict[str, list[str]]:
    """Config group -> its presets (``model`` -> ``llama2_7b`` ...), from the config tree."""
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(config_dir().iterdir())
        if d.is_dir() and not d.name.startswith((".", "_"))
    }


def _closest(word: str, choices: Sequence[str]) -> str:
    import difflib

    near = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f" (did you mean {near[0]}?)" if near else ""


def _unknown_name(overrides: Sequence[str], config_name: str) -> str | None:
    """A one-line message for the first override that names an unknown key or preset, with the closest
    known name (instead of Hydra's advice to append it with +); None when every name is known."""
    presets = groups()
    keys: list[str] | None = None
    for o in overrides:
        if o.startswith("+") or "=" not in o:  # +key=v adds a key on purpose
            continue
        key, value = _key(o), o.partition("=")[2]
        if key.startswith("hydra.") or key == "hydra":
            continue
        if key in presets:
            if value not in presets[key] and value != "null":
                return (
                    f"unknown {key} preset {value!r}{_closest(value, presets[key])}; "
                    f"{key} presets: {' '.join(presets[key])}"
                )
            continue
        if keys is None:
            keys = known_keys(config_name) + [g for g in presets if g != "study"]
        if key not in keys:
            return f"unknown key {key!r}{_closest(key, keys)}; add --help to list every key"
    return None


def run_spec(cfg: dict[str, Any]) -> RunSpec:
    """The RunSpec of a composed config, its stack applied (unknown or missing fields raise
    InvalidSpec)."""
    return config_spec(cfg)


def engine_name(cfg: dict[str, Any]) -> str:
    """The engine named by ``engine=``, or the stack's (``engine=auto``, the default)."""
    return apply_stack(cfg)[1].engine


# The CPU models: every other model (a published preset, a model.hf_config) is GPU-scale. Every command
# applies the same defaults to it (estimate, plan, run, and sweep without a study), so that one set of
# overrides is one configuration and one config_id everywhere (issue 28).
CPU_MODELS = ("tiny", "small", "medium", "tiny_moe")
# What estimate and plan judge a GPU-scale model on unless told otherwise: the published study's
# H100 device and training shape (Fujii et al. 2024; sweeps/study/paper_h100_94gb.yaml).
GPU_DEFAULTS = {"device": "h100_94gb", "train": "paper"}


def gpu_scale_defaults(overrides: Sequence[str]) -> tuple[list[str], str | None]:
    """``estimate`` and ``plan`` of a GPU-scale model: the overrides with ``device=h100_94gb`` and
    ``train=paper`` (sequence 8192, micro-batch 1, BF16) put first where the user chose no device or
    training preset, and a one-line note saying so (or saying that a GPU-scale model is being judged on
    the CPU device); the overrides unchanged and None for a CPU model."""
    chosen = {_key(o): o.partition("=")[2] for o in overrides if "=" in o}
    model = "hf_config" if chosen.get("model.hf_config") not in (None, "", "null") else chosen.get("model")
    if model is None or model in CPU_MODELS:
        return list(overrides), None
    name = model if model != "hf_config" else "model.hf_config"
    if chosen.get("device") == "cpu":
        return list(overrides), (
            f"note: {name} is GPU-scale and device=cpu judges it against the CPU's simulated "
            "capacity (device.memory_gib)"
        )
    added = [f"{group}={preset}" for group, preset in GPU_DEFAULTS.items() if group not in chosen]
    if not added:
        return list(overrides), None
    what = []
    if "device" not in chosen:
        what.append(f"device={GPU_DEFAULTS['device']}")
    if "train" not in chosen:
        import yaml

        t = yaml.safe_load((config_dir() / "train" / f"{GPU_DEFAULTS['train']}.yaml").read_text())
        m = t["num_microbatches"]
        shape = "one micro-batch per pipeline stage" if m is None else f"{m} micro-batches"
        what.append(
            f"train={GPU_DEFAULTS['train']} (seq {t['seq_len']}, micro-batch {t['micro_batch_size']}, "
            f"{shape}, {t['precision']}; train.* keys still apply)"
        )
    return added + list(overrides), (
        f"note: {name} is GPU-scale: judged with the published study's {' and '.join(what)}; "
        "name device= or train= to choose"
    )
