"""Enumerate every valid layout for a number of devices, estimate each, and rank those that fit.

The paper's point: prune the search space before spending GPU time. A layout is a choice of
(dp, tp, pp, cp) with product = gpus, a ZeRO stage, a micro-batch size, a recomputation mode and a
pipeline schedule; the global batch is held fixed so that layouts are compared on the same work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from harness.estimate.comm import Cost, cost
from harness.estimate.core import Estimate, estimate_canonical
from harness.estimate.levels import verdict_bytes, verdict_floor
from harness.estimate.peaks import dominant_stages
from harness.estimate.terms import ENGINES
from harness.spec import (
    PP_SCHEDULES,
    RECOMPUTE,
    InvalidSpec,
    ParallelSpec,
    RunSpec,
    balanced_pp_layers,
    layout_problems,
    type_problems,
)
from harness.spec.identity import canonical_grad_sync, canonical_zero
from harness.spec.validate import ep_unbuilt


@dataclass(frozen=True)
class PlanOptions:
    """What ``plan`` enumerates. ``global_batch_size`` None means one sequence per device (= gpus)."""

    gpus: int
    global_batch_size: int | None = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "op", "full")
    pp_schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    virtual_stages: tuple[int, ...] = (2,)
    max_tp: int = 8
    threshold: float = 0.8
    engine: str = "torch"
    # A profile (harness.analysis.profile.Profile, or any object with total_bytes(Estimate) -> int):
    # when set, whether a layout fits is judged on its calibrated peak.
    calibration: Any = None
    # A fitted step-time model (harness.estimate.steptime.StepTimeModel, a calibration profile's
    # "step_time"): when set and fitted on this device, layouts that fit are ranked by its step time.
    step_time: Any = None
    # Axes the user fixed on the command line (issue 31: parallel.tp=8 given to plan was silently
    # ignored): ("tp", 8), ("pp", 4), ... over dp, tp, pp, cp; the other fixed keys (ZeRO stage,
    # schedule, micro-batch, recomputation) narrow the lists above instead.
    fixed: tuple[tuple[str, int], ...] = ()
    given: tuple[str, ...] = ()  # the overrides that fixed axes or narrowed lists, as the user wrote them

    def __post_init__(self) -> None:
        bad = []
        if self.gpus < 1 or self.max_tp < 1:
            bad.append(f"plan.gpus={self.gpus} and plan.max_tp={self.max_tp} must be >= 1")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            bad.append(f"plan.global_batch_size={self.global_batch_size} must be >= 1 or null")
        checks = (
            ("micro_batch_sizes", self.micro_batch_sizes, lambda x: isinstance(x, int) and x >= 1),
            ("zero_stages", self.zero_stages, lambda x: x in (0, 1, 2, 3)),
            ("recompute", self.recompute, lambda x: x in RECOMPUTE),
            ("pp_schedules", self.pp_schedules, lambda x: x in PP_SCHEDULES),
            ("virtual_stages", self.virtual_stages, lambda x: isinstance(x, int) and x >= 2),
        )
        for name, values, ok in checks:
            wrong = [v for v in values if not ok(v)]
            if not values or wrong:
                bad.append(f"plan.{name}={list(values)} has invalid or no values {wrong}")
        if not self.threshold > 0:
            bad.append(f"threshold={self.threshold} must be > 0")
        if self.engine not in ENGINES:
            bad.append(f"engine {self.engine!r} must be one of {', '.join(ENGINES)}")
        if bad:
            raise ValueError("; ".join(bad))


@dataclass(frozen=True)
class PlanRow:
    estimate: Estimate
    cost: Cost | None  # computed for fitting layouts only: the others are not ranked by speed
    fits: bool
    calibrated_bytes: int | None = None  # the calibration profile's allocated peak, when plan uses one
    device_bytes: int | None = None  # the device level the verdict is based on (levels.verdict_bytes)
    predicted_step_time_s: float | None = None  # the fitted step-time model's, when plan uses one
    predicted_tflops_per_device: float | None = None
    # A layout over the threshold at its allocated level already (``plan_row``): its device level, asked
    # only when shown (plan.show=all, "nothing fits"), since its reserved terms are most of plan's time.
    level: Callable[[], int] | None = field(default=None, compare=False, repr=False)

    @property
    def predicted_bytes(self) -> int:
        """What the verdict is based on: the device level (calibrated when a profile is used)."""
        if self.device_bytes is None and self.level is not None:
            object.__setattr__(self, "device_bytes", self.level())  # (frozen: computed once, kept)
        if self.device_bytes is not None:
            return self.device_bytes
        return self.estimate.total_bytes if self.calibrated_bytes is None else self.calibrated_bytes

    @property
    def floor_bytes(self) -> int:
        """A lower bound of :attr:`predicted_bytes` that costs nothing: the allocated level (calibrated
        where plan uses a profile) and the memory outside the allocator (:func:`levels.verdict_floor`)."""
        if self.device_bytes is not None:
            return self.device_bytes
        return verdict_floor(self.estimate, self.calibrated_bytes)

    @property
    def utilisation(self) -> float:
        return self.predicted_bytes / self.estimate.capacity_bytes

    def sort_key(self) -> tuple:
        """Fitting layouts first, by the fitted step time where plan has a step-time model for the
        device, else by the step-time proxy (or, where the device has no peak and link figures, by
        compute overhead — recomputation and bubble — then traffic), then by memory; the others by
        :attr:`floor_bytes` (their device level where plan computed it; ``plan.show=all`` sorts them by
        their device level)."""
        c = self.cost
        if c is None:
            return (True, math.inf, math.inf, math.inf, self.floor_bytes)
        time_key = c.step_time_s if not math.isnan(c.step_time_s) else math.inf
        if self.predicted_step_time_s is not None:
            time_key = self.predicted_step_time_s
        return (False, time_key, c.compute_factor, c.comm_bytes, self.predicted_bytes)


@dataclass(frozen=True)
class PlanResult:
    rows: tuple[PlanRow, ...]  # every valid layout, ranked
    considered: int
    invalid: int

    @property
    def fitting(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if r.fits)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_groups(base: RunSpec, opts: PlanOptions) -> Iterator[list[RunSpec]]:
    """Every combination of the options for ``opts.gpus`` devices (valid or not), each already in
    canonical form (world_size set, fields without effect at their canonical values), in groups that
    differ only in ZeRO stage and recomputation — which, within the ranges PlanOptions checks, never
    decide whether a layout is possible, so ``plan`` validates each group once."""
    gbs = opts.global_batch_size or opts.gpus
    megatron = opts.engine == "megatron"
    t = base.train
    fixed = dict(opts.fixed)
    policy = base.parallel.fsdp_reshard_after_forward

    def free(axis: str, value: int) -> bool:
        return fixed.get(axis, value) == value

    for tp in _divisors(opts.gpus):
        if tp > opts.max_tp:
            break
        if not free("tp", tp):
            continue
        for pp in _divisors(opts.gpus // tp):
            if not free("pp", pp):
                continue
            schedules = (
                [("1f1b", 1)]
                if pp == 1
                else [
                    (s, v)
                    for s in opts.pp_schedules
                    for v in (opts.virtual_stages if s == "interleaved_1f1b" else (1,))
                ]
            )
            for cp in _divisors(opts.gpus // (tp * pp)):
                dp = opts.gpus // (tp * pp * cp)
                if not (free("cp", cp) and free("dp", dp)):
                    continue
                # ZeRO shards over dp·cp: over one rank every stage is the same run (the runner applies
                # no data parallelism), listed once (issue 31: four rows of one layout); ZeRO-3 that
                # the stack's reshard policy keeps gathered is ZeRO-2, listed once too.
                all_zeros: list[tuple[int, str]] = []
                for zero in opts.zero_stages if dp * cp > 1 else opts.zero_stages[:1]:
                    z, reshard = canonical_zero(zero, policy, pp=pp, shards=dp * cp)
                    if all(z != seen for seen, _ in all_zeros):
                        all_zeros.append((z, reshard))
                for mbs in opts.micro_batch_sizes:
                    if gbs % (dp * mbs):
                        continue
                    m = gbs // (dp * mbs)
                    sync = canonical_grad_sync(t.grad_sync, num_microbatches=m, shards=dp * cp, pp=pp)
                    trains = [
                        dataclasses.replace(
                            t, micro_batch_size=mbs, num_microbatches=m, recompute=rc, grad_sync=sync
                        )
                        for rc in opts.recompute
                    ]
                    for schedule, v in schedules:
                        layers = stage_split(base, pp, v)
                        for ep in expert_degrees(base.model, dp * cp):
                            if not free("ep", ep):
                                continue
                            group = []
                            for zero, reshard in all_zeros:
                                par = candidate_parallel(
                                    dp,
                                    tp,
                                    pp,
                                    cp,
                                    zero,
                                    reshard,
                                    schedule,
                                    v,
                                    opts.gpus,
                                    layers=layers,
                                    ep=ep,
                                )
                                group += [
                                    RunSpec(base.model, par, train, base.device)
                                    for train in trains
                                    # (layouts this runner does not build: listed for Megatron's)
                                    if megatron or not ep_unbuilt(ep, dp * cp, zero, train.recompute)
                                ]
                            if group:
                                yield group


def expert_degrees(m, shards: int) -> list[int]:
    """The expert-parallel degrees ``plan`` tries for ``shards`` = dp·cp ranks: 1, and for a mixture of
    experts every degree that divides both the experts and dp·cp (torchtitan's and Megatron's ep is
    carved from those ranks)."""
    if not m.num_experts:
        return [1]
    return [e for e in _divisors(shards) if m.num_experts % e == 0]


def stage_split(base: RunSpec, pp: int, v: int) -> tuple[int, ...]:
    """A candidate's ``pp_layers``: the user's own where they gave one for this many stages, else ()
    where the layers divide evenly, else :func:`balanced_pp_layers` without interleaving (() where no
    split is offered: the candidate is then invalid, with validation's reason)."""
    given = base.parallel.pp_layers
    if given and len(given) == pp and all(c % v == 0 for c in given):
        return tuple(given) if len(set(given)) > 1 else ()
    if v > 1:
        # Not under interleaving: an interleaved layout's every stage is estimated (peaks.dominant_stages),
        # and its uneven splits (70B on pp 16-32 × v 2) doubled plan's time on 1,024 GPUs (1.2 → 2.7 s).
        # Its split is the user's to give (parallel.pp_layers).
        return ()
    return balanced_pp_layers(base.model.num_layers, pp, v) or ()


def candidate_parallel(
    dp: int,
    tp: int,
    pp: int,
    cp: int,
    zero: int,
    reshard: str,
    schedule: str,
    v: int,
    world: int,
    *,
    layers: tuple[int, ...] = (),
    ep: int = 1,
) -> ParallelSpec:
    """A candidate's parallel section in canonical form: sequence parallelism with tp, load-balanced
    context parallelism with cp, the world size set, ``layers`` its uneven stages (or ()). Built field by
    field (dataclasses.replace costs ~10 µs a call, and plan builds tens of thousands for a 1,024-GPU
    plan)."""
    return ParallelSpec(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        zero_stage=zero,
        sequence_parallel=tp > 1,
        pp_schedule=schedule,
        virtual_stages=v,
        cp_load_balance=cp > 1,
        world_size=world,
        fsdp_reshard_after_forward=reshard,
        pp_layers=layers,
        ep=ep,
    )


def candidates(base: RunSpec, opts: PlanOptions) -> Iterator[RunSpec]:
    """Every candidate of :func:`candidate_groups`, one by one."""
    for group in candidate_groups(base, opts):
        yield from group


def plan(base: RunSpec, opts: PlanOptions) -> PlanResult:
    """Estimate every valid candidate layout of ``base``'s model, training shape and device."""
    wrong_types = type_problems(base)
    if wrong_types:
        raise InvalidSpec(wrong_types)
    rows, considered, invalid = [], 0, 0
    timer = opts.step_time if opts.step_time is not None and opts.step_time.applies_to(base) else None
    for group in candidate_groups(base, opts):
        considered += len(group)
        if layout_problems(group[0]):
            invalid += len(group)
            continue
        stages = dominant_stages(group[0].parallel, group[0].train, group[0].model)
        rows += [plan_row(spec, opts, stages=stages, timer=timer) for spec in group]
    rows.sort(key=PlanRow.sort_key)
    return PlanResult(tuple(rows), considered, invalid)


def plan_row(spec: RunSpec, opts: PlanOptions, *, stages=None, timer=None) -> PlanRow:
    """One canonical candidate as ``plan`` judges and ranks it (also ``plan.include``: a layout the
    user names, whether or not plan's lists hold it). ``timer``: the step-time model where it applies."""
    est = estimate_canonical(spec, engine=opts.engine, stages=stages)
    calibrated = None if opts.calibration is None else opts.calibration.total_bytes(est)
    if verdict_floor(est, calibrated) > opts.threshold * est.capacity_bytes:
        # Over at the allocated level: the reserved level (never below it) cannot fit. Measured on
        # Llama-3-70B over 1,024 H100s: 8,598 of 12,424 valid layouts, half of plan's time saved.
        level = functools.partial(verdict_bytes, est, opts.calibration, allocated=calibrated)
        return PlanRow(est, None, False, calibrated, level=level)
    device = verdict_bytes(est, opts.calibration, allocated=calibrated)
    fits = device / est.capacity_bytes <= opts.threshold
    timed = {}
    if fits and timer is not None:
        step = timer.step_time_s(spec)
        timed = {
            "predicted_step_time_s": step,
            "predicted_tflops_per_device": timer.tflops_per_device(spec, step) if step > 0 else None,
        }
    return PlanRow(est, cost(spec) if fits else None, fits, calibrated, device, **timed)


# What ``plan.include`` may name, with its default where the layout leaves it out.
INCLUDE_KEYS = {
    "dp": None,  # derived: the devices over tp·pp·cp
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "zero_stage": 0,
    "pp_schedule": "1f1b",
    "virtual_stages": 1,
    "micro_batch_size": 1,
    "recompute": None,  # the base's (the stack's)
    "ep": 1,
}


def include_spec(base: RunSpec, opts: PlanOptions, layout: dict[str, Any]) -> RunSpec:
    """The candidate ``plan.include`` names (``{tp: 2, pp: 4, zero_stage: 1, ...}``: the keys of
    :data:`INCLUDE_KEYS`), built as :func:`candidate_groups` builds its own: ``opts.gpus`` devices, the
    micro-batches the global batch leaves, the stack's reshard and gradient-sync choices in canonical
    form. Not validated here (``canonical`` does, with the arithmetic in the message); a key plan
    does not know, or a batch the layout cannot split, is a ValueError."""
    unknown = sorted(set(layout) - set(INCLUDE_KEYS))
    if unknown:
        raise ValueError(
            f"plan.include: unknown key(s) {', '.join(unknown)} (known: {', '.join(INCLUDE_KEYS)})"
        )
    v = {k: layout.get(k, d) for k, d in INCLUDE_KEYS.items()}
    tp, pp, cp, mbs = int(v["tp"]), int(v["pp"]), int(v["cp"]), int(v["micro_batch_size"])
    if min(tp, pp, cp, mbs) < 1 or opts.gpus % (tp * pp * cp):
        raise ValueError(f"plan.include: tp·pp·cp = {tp}·{pp}·{cp} does not divide plan.gpus={opts.gpus}")
    dp = int(v["dp"]) if v["dp"] is not None else opts.gpus // (tp * pp * cp)
    gbs = opts.global_batch_size or opts.gpus
    if dp * mbs < 1 or gbs % (dp * mbs):
        raise ValueError(
            f"plan.include: global batch {gbs} is not a whole number of micro-batches of {mbs} "
            f"sequences over dp={dp}"
        )
    m = gbs // (dp * mbs)
    t = base.train
    zero, reshard = canonical_zero(
        int(v["zero_stage"]), base.parallel.fsdp_reshard_after_forward, pp=pp, shards=dp * cp
    )
    train = dataclasses.replace(
        t,
        micro_batch_size=mbs,
        num_microbatches=m,
        recompute=v["recompute"] or t.recompute,
        grad_sync=canonical_grad_sync(t.grad_sync, num_microbatches=m, shards=dp * cp, pp=pp),
    )
    vs = int(v["virtual_stages"])
    par = candidate_parallel(
        dp,
        tp,
        pp,
        cp,
        zero,
        reshard,
        v["pp_schedule"],
        vs,
        opts.gpus,
        layers=stage_split(base, pp, vs),
        ep=int(v["ep"]),
    )
    return RunSpec(base.model, par, train, base.device)


def include_rank(result: PlanResult, row: PlanRow) -> int | None:
    """Where ``row`` ranks among ``result``'s fitting layouts (1 = first), None when it does not fit:
    its own place if plan considered it, else the place its sort key takes."""
    if not row.fits:
        return None
    key = row.sort_key()
    return 1 + sum(1 for r in result.fitting if r.sort_key() < key and r.estimate.spec != row.estimate.spec)
