"""`harness sweep`: a Hydra multirun over the sweeps/ tree, each point one `run`, one row each."""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Hydra's own log lines ("Launching 8 jobs locally", one per job) interleave with the sweep's progress
# lines (issue 16): quiet unless the command line chooses a hydra/hydra_logging itself.
QUIET = "hydra/hydra_logging=disabled"


def retry_as_list(override: str) -> str:
    """``sweep.retry=timeout,crash`` is one list, not a Hydra sweep over two values (which would run
    each point once per value, the second time as a duplicate)."""
    key, sep, value = override.partition("=")
    if sep and key.lstrip("+") == "sweep.retry" and value and not value.startswith("["):
        return f"{key}=[{value}]"
    return override


def _check_creatable(path: str, key: str) -> None:
    """A directory the sweep writes in, made now (Hydra would make it anyway, after the claims): a
    path it cannot make is one line (ConfigError), not Hydra's traceback (issue 29)."""
    from pathlib import Path

    from harness.cli.config import ConfigError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}={path}: cannot create it ({exc.strerror or exc})") from None


def check_overrides(overrides: Sequence[str]) -> None:
    """Compose the sweep's first point before Hydra runs: a bad key or value is one line (ConfigError,
    exit 2) instead of Hydra's several (issue 12)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from harness.cli.config import ConfigError, compose

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(" ".join(str(exc).split())) from None
    first, swept = [], []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            first.append(f"{o.get_key_element()}={values[0]}" if values else o.input_line)
            swept += [(i, f"{o.get_key_element()}={v}") for v in values[1:]]
        else:
            first.append(o.input_line)
    from harness.spec import InvalidSpec, config_spec, type_problems
    from harness.spec.stacks import require_runnable

    cfg = compose(first)
    require_runnable(cfg, "sweep")
    for o in overrides:  # issue 29: an unusable hydra.sweep.dir was Hydra's traceback after the claims
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "hydra.sweep.dir" and value:
            _check_creatable(value.strip("'\""), "hydra.sweep.dir")
    # Every swept value of a spec key has the key's type (issue 29: parallel.tp=1,abc made an invalid row
    # for "abc", exit 0, where estimate calls it a usage error): each composed with the others' first.
    configs = [cfg] + [
        compose([*first[:i], value, *first[i + 1 :]])
        for i, value in swept
        if value.startswith(("model.", "parallel.", "train.", "device."))
    ]
    for one in configs:
        try:
            wrong = type_problems(config_spec(one))
        except InvalidSpec as exc:
            wrong = exc.reasons
        if wrong:
            raise ConfigError("; ".join(wrong))


def sweep(overrides: Sequence[str]) -> int:
    import hydra
    from omegaconf import OmegaConf

    from harness.cli.config import config_dir
    from harness.sweep.launch import run_job

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def task(cfg) -> str:
        plain = OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
        )
        return run_job(plain)

    from harness.cli.config import quote_path

    overrides = [quote_path(retry_as_list(o)) for o in overrides]
    if not any(o.lstrip("+~").startswith("study=") for o in overrides):  # a study names its own device
        from harness.cli.config import gpu_scale_defaults

        overrides, note = gpu_scale_defaults(overrides)
        if note:
            print(note, file=sys.stderr)
    check_overrides(overrides)
    quiet = [] if any(o.lstrip("+~").startswith("hydra/hydra_logging=") for o in overrides) else [QUIET]
    argv = sys.argv
    sys.argv = ["harness sweep", "--multirun", *quiet, *overrides]  # hydra.main reads its arguments from argv
    try:
        task()
    except SystemExit as exc:
        if isinstance(exc.code, str):  # the sweep's own one-line errors: exit 2 like every usage error
            print(exc.code, file=sys.stderr)
            return 2
        if exc.code not in (None, 0):  # Hydra has printed its error (a bad override): a usage error
            return 2
    finally:
        sys.argv = argv
    return 0
