"""``hydra/sweeper=harness``: Hydra's basic grid sweeper, filtered before launch.

Hydra's basic sweeper cannot filter, so every impossible layout would become a job (on Slurm a GPU
allocation that starts Python only to exit). This one composes each point's config first and:
- writes an impossible layout's row (``status=invalid`` with the reason) without launching it;
- skips a point whose config_id already has a result in ``results_dir`` (resume);
- with ``sweep.prune_predicted_oom=true``, writes ``status=skipped_predicted_oom`` for a point whose
  estimate exceeds ``sweep.prune_factor`` × the device's capacity, without launching it.
The rest are launched in batches as the basic sweeper does. It also records the planned points so that
each job can print the sweep's progress.
"""

import logging
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


@dataclass
class HarnessSweeperConf:
    _target_: str = "hydra_plugins.harness_sweeper.harness_sweeper.HarnessSweeper"
    max_batch_size: Any = None
    params: Any = None


ConfigStore.instance().store(group="hydra/sweeper", name="harness", node=HarnessSweeperConf)


class HarnessSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Any = None, params: Any = None) -> None:  # no __future__: Hydra
        # loads plugins outside sys.modules, where dataclasses cannot resolve string annotations
        super().__init__(max_batch_size=max_batch_size, params=params)

    def validate_batch_is_legal(self, batch) -> None:
        """No-op: ``split_arguments`` has already composed every point (the basic sweeper would compose
        each one once more here, ~0.2 s a point on 2 cores, only to check that it composes)."""

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        from harness.sweep import start_progress, triage

        points = [p for batch in BasicSweeper.split_arguments(overrides, None) for p in batch]
        configs = []
        for point in points:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(point))
            plain = OmegaConf.to_container(
                OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
            )
            configs.append(plain)
        launch, summary = triage(points, configs)
        print(summary, flush=True)
        keep = [p for p, _ in launch]
        if configs:
            start_progress(configs[0]["results_dir"], name=configs[0]["sweep"]["name"], launched=len(keep))
        size = max_batch_size or len(keep) or 1
        return [keep[i : i + size] for i in range(0, len(keep), size)]
