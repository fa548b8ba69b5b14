"""`harness sweep`: a Hydra multirun over the sweeps/ tree, each point one `run`, one row each."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def sweep(overrides: Sequence[str]) -> int:
    import hydra
    from omegaconf import OmegaConf

    from harness.cli.config import config_dir
    from harness.sweep import run_job

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def task(cfg) -> str:
        plain = OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
        )
        return run_job(plain)

    argv = sys.argv
    sys.argv = ["harness sweep", "--multirun", *overrides]  # hydra.main reads its arguments from argv
    try:
        task()
    finally:
        sys.argv = argv
    return 0
