"""``plan ... plan.emit=DIR/study/NAME.yaml``: the top fitting layouts as a study that ``harness sweep``
runs as it is — the paper's loop, prune by estimate, then measure the survivors.

The file is a Hydra study like ``sweeps/study/*.yaml``: the model, device and training shape written
out field by field (so a ``model.hf_config`` or a changed field survives), and one single-point grid per
layout under ``hydra.sweeper.grids`` (the harness sweeper sweeps their union). It must sit in a folder
named ``study`` so that Hydra finds it as ``+study=NAME`` once that folder's parent is on the search
path (``hydra.searchpath=[file://DIR]``; not needed inside the project's own ``sweeps/study``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import yaml

from harness.spec import RunSpec, config_id

# The fields each layout sets; everything else is shared by the study.
POINT_FIELDS = {
    "parallel": (
        "dp",
        "tp",
        "pp",
        "cp",
        "zero_stage",
        "sequence_parallel",
        "pp_schedule",
        "virtual_stages",
        "cp_load_balance",
        "fsdp_reshard_after_forward",  # the stack's policy, as canonical() left it for this layout
    ),
    # recompute_every too: canonical() resets it to 1 unless recompute is full, so taken from the first
    # layout it would have reset every full layout's N.
    "train": ("micro_batch_size", "num_microbatches", "recompute", "recompute_every"),
}


def study_target(path: str | Path, config_dir: Path) -> tuple[Path, str, str]:
    """The file, its study name and the sweep command for ``plan.emit=PATH``; a path that Hydra could
    not find as a study is refused with what to write instead."""
    path = Path(path)
    if path.suffix != ".yaml" or path.parent.name != "study":
        raise ValueError(
            f"plan.emit={path}: write it as DIR/study/NAME.yaml (Hydra finds a study in a folder named "
            "study), e.g. plans/study/my_plan.yaml"
        )
    name = path.stem
    root = path.resolve().parent.parent
    if root != config_dir.resolve() and (config_dir / "study" / f"{name}.yaml").exists():
        # Hydra finds the built-in study of that name first (issue 29: plan.emit=plans/study/cpu_smoke.yaml
        # printed a command that ran the built-in cpu_smoke, not the emitted layouts).
        raise ValueError(f"plan.emit={path}: a built-in study is named {name}; name yours otherwise")
    search = "" if root == config_dir.resolve() else f"hydra.searchpath=[file://{root}] "
    return path, name, f"harness sweep {search}+study={name}"


def _point(spec: RunSpec) -> dict[str, object]:
    point: dict[str, object] = {
        f"{section}.{name}": getattr(getattr(spec, section), name)
        for section, names in POINT_FIELDS.items()
        for name in names
    }
    if spec.parallel.pp_layers:  # uneven stages: one list value (the sweeper passes it as [a, b, ...])
        point["parallel.pp_layers"] = list(spec.parallel.pp_layers)
    return point


def study_text(specs: Sequence[RunSpec], *, name: str, how: str, command: str) -> str:
    """The study file of ``specs`` (canonical, one model, device and sequence length), in plan order."""
    first = specs[0]
    shared_train = {
        k: v for k, v in dataclasses.asdict(first.train).items() if k not in POINT_FIELDS["train"]
    }
    body = {
        "model": dataclasses.asdict(first.model),
        "device": dataclasses.asdict(first.device),
        "train": shared_train,
        "parallel": {"world_size": None},
        "sweep": {"name": name},
        "results_dir": f"results/{name}",
        "hydra": {"mode": "MULTIRUN", "sweeper": {"grids": [_point(s) for s in specs]}},
    }
    if first.device.name != "cpu":  # a point wider than a node asks for ceil(world / per node) nodes
        body["sweep"]["ranks_per_node"] = first.device.gpus_per_node
    ids = ", ".join(config_id(s) for s in specs)
    header = [
        "# @package _global_",
        f"# Written by harness plan: {how}.",
        f"# The {len(specs)} layouts in plan's order (config_ids {ids}).",
        "# Measure them (on a cluster add hydra/launcher=submitit_slurm and its partition and account):",
        f"#   {command}",
        f"#   harness results status results_dir=results/{name}",
        f"#   harness calibrate results_dir=results/{name}",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def write_study(
    path: str | Path, specs: Sequence[RunSpec], *, how: str, config_dir: Path
) -> tuple[Path, str]:
    """Write the study of ``specs`` to ``path``; returns the file and the command that sweeps it."""
    if not specs:
        raise ValueError(f"plan.emit={path}: no layout fits, nothing to write")
    target, name, command = study_target(path, config_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(study_text(specs, name=name, how=how, command=command))
    return target, command
