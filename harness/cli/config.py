"""Compose the sweeps/ config tree with Hydra and convert it, strictly, into frozen specs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.specs import RunSpec, from_dict


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
    dicts. Unknown keys, unknown presets and malformed overrides raise :class:`ConfigError`."""
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
        raise ConfigError(_one_line(exc)) from None
    finally:
        GlobalHydra.instance().clear()


def run_spec(cfg: dict[str, Any]) -> RunSpec:
    """The RunSpec of a composed config (unknown or missing fields raise InvalidSpec)."""
    return from_dict({k: cfg.get(k) for k in ("model", "parallel", "train", "device")})


def engine_name(cfg: dict[str, Any]) -> str:
    engine = cfg.get("engine")
    return engine["name"] if isinstance(engine, dict) else str(engine)
