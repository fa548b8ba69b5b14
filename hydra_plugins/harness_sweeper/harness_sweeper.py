"""``hydra/sweeper=harness``: Hydra's basic grid sweeper, filtered before launch.

Hydra's basic sweeper cannot filter, so every impossible layout would become a job (on Slurm a GPU
allocation that starts Python only to exit). This one composes each point's config first and:
- writes an impossible layout's row (``status=invalid`` with the reason) without launching it;
- skips a point whose config_id already has a result in ``results_dir`` (resume);
- with ``sweep.prune_predicted_oom=true``, writes ``status=skipped_predicted_oom`` for a point whose
  estimate exceeds ``sweep.prune_factor`` × the device's capacity, without launching it;
- with ``sweep.dry_run=true``, only prints what it would do.
The rest are launched in batches as the basic sweeper does. It also records the planned points so that
each job can print the sweep's progress.

With ``sweep.ranks_per_node`` set and a launcher that places jobs on nodes (``submitit_slurm``), each
point asks for ``ceil(world / ranks_per_node)`` nodes: points are batched by that count and the
launcher's ``nodes`` is set for each batch (Hydra's launcher parameters are otherwise one value for
the whole sweep). Each node's task then forks its block of the point's ranks (harness.sweep.launch.run_job).

A study that is not one cartesian product lists several under ``hydra.sweeper.grids``: each grid's
keys are combined with ``params`` (a grid's value wins over params for the same key, the command line
wins over both), the union of the grids' points is swept, and a point in two grids runs once.
"""

import logging
from collections import Counter
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
    grids: Any = None


ConfigStore.instance().store(group="hydra/sweeper", name="harness", node=HarnessSweeperConf)


class HarnessSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Any = None, params: Any = None, grids: Any = None) -> None:
        # (no __future__ import: Hydra loads plugins outside sys.modules, where dataclasses cannot
        # resolve string annotations)
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.grids = grids
        self.arguments: list[str] = []
        self.nodes: dict[tuple[str, ...], int | None] = {}  # a launched point -> its node count
        self.token = ""  # this sweep's claims (harness.sweep.claims)
        self.results_dir: str | None = None
        self.planned: list[str] = []

    def sweep(self, arguments):
        from harness.sweep import claims
        from harness.sweep.progress import closing_summary

        self.arguments = list(arguments)
        self.token = claims.new_token()
        try:
            returns = super().sweep(arguments)
        finally:  # points claimed and never run (a lost job, an interruption) are free again
            claims.release_all(self.token)
        if self.results_dir is not None and self.planned:
            print(closing_summary(self.results_dir, self.planned), flush=True)
        return returns

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher.launch = _report_lost_jobs(_on_nodes(self.launcher, self.nodes))

    def validate_batch_is_legal(self, batch) -> None:
        """No-op: ``split_arguments`` has already composed every point (the basic sweeper would compose
        each one once more here, ~0.2 s a point on 2 cores, only to check that it composes)."""

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        try:
            return self._split_arguments(overrides, max_batch_size)
        except OSError as exc:  # a full disk or a read-only results_dir: one line, nothing launched
            raise SystemExit(f"harness sweep: error: {exc.strerror or exc}: {exc.filename or ''}") from None

    def _split_arguments(self, overrides, max_batch_size):
        from harness.sweep.launch import check_writable, nodes_for, point_id, triage
        from harness.sweep.progress import start_progress

        points = [
            p for o in self._grid_overrides(overrides) for p in BasicSweeper.split_arguments(o, None)[0]
        ]
        configs = []
        for point in points:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(point))
            plain = OmegaConf.to_container(
                OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
            )
            configs.append(plain)
        dry_run = bool(configs and configs[0]["sweep"].get("dry_run"))
        if not dry_run:
            for results_dir in sorted({c["results_dir"] for c in configs}):
                check_writable(results_dir)
        launch, summary = triage(points, configs, write=not dry_run, token=None if dry_run else self.token)
        print(summary, flush=True)
        # Each job runs under its sweep's claim: the token travels as an override (to a Slurm node too).
        launch = [([*p, f"++sweep.claim={self.token}"], cfg) for p, cfg in launch]
        self.nodes.update({tuple(p): nodes_for(cfg) for p, cfg in launch})
        by_nodes = Counter(self.nodes[tuple(p)] for p, _ in launch)
        if any(by_nodes):  # sweep.ranks_per_node is set: say what the cluster will be asked for
            print(
                "harness sweep: jobs by size: "
                + ", ".join(f"{by_nodes[n]} on {n} node{'s' * (n > 1)}" for n in sorted(by_nodes)),
                flush=True,
            )
        if dry_run:
            print(
                "harness sweep: dry run (sweep.dry_run=true): nothing written, nothing launched", flush=True
            )
            return []
        keep = [p for p, _ in launch]
        if configs:
            self.results_dir = configs[0]["results_dir"]
            self.planned = sorted({point_id(c) for c in configs})
            start_progress(
                configs[0]["results_dir"],
                name=configs[0]["sweep"]["name"],
                launched=len(keep),
                planned=sorted({point_id(c) for c in configs}),
            )
        size = max_batch_size or len(keep) or 1
        batches = []
        for count in sorted({self.nodes[tuple(p)] or 0 for p in keep}):  # one node count per batch
            group = [p for p in keep if (self.nodes[tuple(p)] or 0) == count]
            batches += [group[i : i + size] for i in range(0, len(group), size)]
        return batches

    def _grid_overrides(self, overrides):
        """The parsed overrides of each grid (the basic sweeper's one product when there are no grids)."""
        if not self.grids:
            return [overrides]
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        out = []
        for grid in self.grids:
            merged = {**dict(self.params or {}), **dict(grid)}
            strings = [f"{k}={v}" for k, v in merged.items()] + self.arguments
            out.append(parser.parse_overrides(strings))
        return out


def _on_nodes(launcher, nodes: dict):
    """``launcher.launch`` that first sets the launcher's ``nodes`` to the batch's count, when the
    study asks for per-point node counts (``sweep.ranks_per_node``) and the launcher is submitit's
    Slurm launcher (it reads ``self.params`` at each launch). Other launchers run every rank where
    they are (submitit's local executor refuses more than one node)."""
    launch = launcher.launch

    def wrapped(job_overrides, initial_job_idx):
        count = nodes.get(tuple(job_overrides[0])) if job_overrides else None
        if count is not None and getattr(launcher, "_EXECUTOR", None) == "slurm":
            launcher.params["nodes"] = count
        return launch(job_overrides, initial_job_idx=initial_job_idx)

    return wrapped


def _report_lost_jobs(launch):
    """A job that ends without reporting (Slurm's time limit, a lost node) makes submitit raise inside
    ``launch`` and would abort the whole sweep. Every job writes its own row, so the batch's other
    points are safe: say what happened and go on; the lost point has no row, so the next run of the
    same sweep runs it again."""

    def wrapped(job_overrides, initial_job_idx):
        try:
            return launch(job_overrides, initial_job_idx=initial_job_idx)
        except Exception as exc:  # reported, and the sweep goes on
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            print(
                f"harness sweep: a job of this batch ended without reporting ({type(exc).__name__}: "
                f"{first}); its point has no row and the next run of this sweep runs it again",
                flush=True,
            )
            return []

    return wrapped
