"""The one place that adds the terms up: per pipeline stage, then the most-loaded rank as an explicit max.

A rank's peak (ESTIMATOR.md, STYLE.md 1 and 3):

  total = states + max(forward/backward terms, optimizer-step terms)

where states are ``params + grads + optimizer`` (``grads``: the gradients alive at the forward/backward
peak), the forward/backward terms are every activation and temporary buffer alive at the end of the
last forward / start of backward, and the optimizer step's terms come after backward has freed the
activations: its intermediates, and (torch) the gradients that backward made after the peak
(``step_grads``; the runner frees them every step). Engine `paper` is its closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from harness.estimate import levels
from harness.estimate.flops import model_flops_per_step
from harness.estimate.paper import IGNORED_FIELDS, paper_terms
from harness.estimate.stage import stage_estimate
from harness.estimate.terms import (
    BUFFER_TERMS,
    ENGINES,
    FLOPS_CONVENTION,
    STATE_TERMS,
    STEP_TERMS,
    TERMS,
    StageEstimate,
)
from harness.spec import RunSpec, canonical, config_id, stage_view, stage_views
from harness.spec.validate import runner_limits


@dataclass(frozen=True)
class Estimate:
    """One configuration's estimate: every stage, the most-loaded one, FLOPs per step."""

    spec: RunSpec
    engine: str
    stages: tuple[StageEstimate, ...]
    flops_per_step: int
    flops_convention: str = FLOPS_CONVENTION
    notes: tuple[str, ...] = field(default=())
    # Each stage's view of the spec (spec.stage_views: the spec itself unless parallel.pp_layers).
    views: tuple[RunSpec, ...] | None = field(default=None, compare=False, repr=False)
    worst: StageEstimate = field(init=False)  # the most-loaded rank

    def __post_init__(self) -> None:
        if self.views is None:
            object.__setattr__(self, "views", stage_views(self.spec))
        # The explicit max over stages (max() keeps the first stage on ties).
        object.__setattr__(self, "worst", max(self.stages, key=lambda s: s.total_bytes))

    @property
    def total_bytes(self) -> int:
        """The allocated level: the tensors alive at the most-loaded rank's peak."""
        return self.worst.total_bytes

    def reserved_terms(self, stage: StageEstimate | None = None) -> dict[str, int]:
        """The reserved level's terms (levels.RESERVED_TERMS) of ``stage`` (default: the reserved worst)."""
        if stage is None:
            return dict(self._reserved[1])
        return dict(self._stage_reserved_terms(stage))

    def _stage_reserved_terms(self, stage: StageEstimate) -> dict[str, int]:
        """:meth:`reserved_terms` of one stage, computed once per stage (the caller must not change it)."""
        cache = self.__dict__.setdefault("_reserved_cache", {})
        if stage.stage not in cache:
            cache[stage.stage] = levels.reserved_terms(
                self.views[stage.stage], stage.terms, stage=stage.stage, engine=self.engine
            )
        return cache[stage.stage]

    def reserved_terms_bound(self, stage: StageEstimate) -> int:
        """At least the sum of ``stage``'s :meth:`reserved_terms`, cheaply (levels.reserved_upper_bound)."""
        view = self.views[stage.stage]
        bound = levels.reserved_upper_bound(view, stage.terms, stage=stage.stage, engine=self.engine)
        return bound - stage.total_bytes

    @cached_property
    def _reserved(self) -> tuple[StageEstimate, dict[str, int], int]:
        """(the stage whose reserved level is highest, its reserved terms, that level); computed once:
        ``plan`` asks every candidate for its device level."""
        stage, total = levels.worst_by_bound(
            self.stages,
            lambda s: s.total_bytes + self.reserved_terms_bound(s),
            lambda s: s.total_bytes + sum(self._stage_reserved_terms(s).values()),
        )
        return stage, self._stage_reserved_terms(stage), total

    @property
    def reserved_worst(self) -> StageEstimate:
        """The stage whose reserved level is highest (the allocated worst on the CPU, where it adds 0)."""
        return self._reserved[0]

    @property
    def reserved_total_bytes(self) -> int:
        """The reserved level: allocated plus what the caching allocator's segments add (uncalibrated:
        segment rounding and cuBLAS workspaces; calibration adds the fitted fragmentation)."""
        return self._reserved[2]

    @cached_property
    def outside_terms(self) -> dict[str, int]:
        return levels.outside_terms(self.spec)

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(self.outside_terms.values())

    @property
    def device_total_bytes(self) -> int:
        """The device level, what runs out: reserved plus the CUDA context and NCCL's buffers."""
        return self.reserved_total_bytes + self.outside_allocator_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.spec.device.memory_bytes

    @property
    def utilisation(self) -> float:
        """Predicted allocated peak over the device's capacity (the paper's utilisation)."""
        return self.total_bytes / self.capacity_bytes

    @property
    def device_utilisation(self) -> float:
        """Predicted device level over the capacity: what the verdict is based on."""
        return self.device_total_bytes / self.capacity_bytes

    def as_record(self, *, threshold: float | None = None) -> dict[str, Any]:
        """Flat JSON-ready fields: ``<term>_bytes`` of the worst stage, totals, and every stage."""
        worst = self.worst
        out: dict[str, Any] = {
            "config_id": config_id(self.spec),
            "engine": self.engine,
            "model": self.spec.model.name,
            "device": self.spec.device.name,
            "world_size": self.spec.parallel.world,
            "worst_stage": worst.stage,
        }
        out.update({f"{k}_bytes": worst.terms[k] for k in TERMS})
        out["states_bytes"] = sum(worst.terms[k] for k in STATE_TERMS)
        out["temporaries_bytes"] = sum(worst.terms[k] for k in BUFFER_TERMS + STEP_TERMS)
        out["total_bytes"] = self.total_bytes
        out.update({f"{k}_bytes": v for k, v in self.reserved_terms().items()})
        out["reserved_total_bytes"] = self.reserved_total_bytes
        out.update({f"{k}_bytes": v for k, v in self.outside_terms.items()})
        out["outside_allocator_bytes"] = self.outside_allocator_bytes
        out["device_total_bytes"] = self.device_total_bytes
        out["capacity_bytes"] = self.capacity_bytes
        # One name per level in every command's JSON (issue 31 item 6); ``utilisation`` stays the
        # allocated level's, as it always was here.
        out["utilisation"] = self.utilisation
        out["allocated_utilisation"] = self.utilisation
        out["reserved_utilisation"] = self.reserved_total_bytes / self.capacity_bytes
        out["device_utilisation"] = self.device_utilisation
        if threshold is not None:
            out["threshold"] = threshold
            out["fits"] = self.device_utilisation <= threshold
        out["flops_per_step"] = self.flops_per_step
        out["flops_convention"] = self.flops_convention
        out["stages"] = [
            {"stage": s.stage, **{f"{k}_bytes": s.terms[k] for k in TERMS}, "total_bytes": s.total_bytes}
            for s in self.stages
        ]
        out["notes"] = list(self.notes)
        return out


def estimate(spec: RunSpec, *, engine: str = "torch") -> Estimate:
    """Estimate one configuration's per-rank peak memory with ``engine`` (paper, megatron or torch).

    Raises :class:`harness.spec.InvalidSpec` for an impossible layout and ``ValueError`` for an
    unknown engine.
    """
    return estimate_canonical(canonical(spec), engine=engine)


def estimate_canonical(
    spec: RunSpec, *, engine: str = "torch", stages: tuple[int, ...] | None = None
) -> Estimate:
    """:func:`estimate` of a spec already returned by :func:`harness.spec.canonical` (no re-validation:
    ``plan`` validates each candidate once). ``stages`` limits the stages computed (``plan`` passes
    :func:`dominant_stages`); by default every stage is."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} must be one of {', '.join(ENGINES)}")
    flops = model_flops_per_step(spec, convention=FLOPS_CONVENTION)
    if engine == "paper":
        terms = dict.fromkeys(TERMS, 0)
        first = stage_view(spec, 0)  # the paper's form assumes even stages: its first stage's blocks
        terms.update(paper_terms(first.model, first.parallel, first.train))
        notes = ("paper: closed form for the first stage; ignores " + ", ".join(IGNORED_FIELDS),)
        if spec.model.moe:
            notes += (
                "paper: the published form has no experts: this mixture of experts is counted as a dense "
                f"model whose MLP is ffn_hidden_size {spec.model.ffn_hidden_size} wide",
            )
        return Estimate(spec, engine, (StageEstimate.of(0, terms),), flops, notes=notes)
    ids = range(spec.parallel.pp) if stages is None else stages
    # Each stage from its own blocks (spec.stage_views: the spec itself unless parallel.pp_layers).
    views = stage_views(spec)
    stages = tuple(stage_estimate(views[i], i, engine) for i in ids)
    notes = ()
    if engine == "torch" and (unbuilt := runner_limits(spec)):
        notes = tuple(f"torch: {u}; the figure is the engine's arithmetic, never measured" for u in unbuilt)
    if engine == "megatron" and spec.model.moe:
        notes = (
            "megatron: the expert blocks' activations are Megatron-LM's alltoall dispatcher with "
            "TransformerEngine's grouped GEMM, read from its source (harness/estimate/moe.py), never "
            "measured; under op recomputation torchtitan's policy",
        )
    if engine == "megatron" and spec.train.loss_chunks > 1:
        notes += (
            f"megatron: train.loss_chunks={spec.train.loss_chunks} is not modelled: Megatron's loss "
            "runs on the whole logits at once",
        )
    return Estimate(spec, engine, stages, flops, views=views, notes=notes)
