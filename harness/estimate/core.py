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
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

from harness.estimate import activations as act
from harness.estimate import buffers as buf
from harness.estimate import levels
from harness.estimate import states as st
from harness.estimate.flops import model_flops_per_step
from harness.estimate.paper import IGNORED_FIELDS, paper_terms
from harness.estimate.params import largest_param, stage_params
from harness.specs import ModelSpec, ParallelSpec, RunSpec, TrainSpec, canonical, config_id

ENGINES = ("paper", "megatron", "torch")
STATE_TERMS = ("params", "grads", "optimizer")
ACTIVATION_TERMS = ("activations", "token_ids", "output_activations", "logits")
BUFFER_TERMS = (
    "param_copies",
    "fsdp_allgather",
    "grad_reduce",
    "tp_allgather",
    "pp_p2p",
    "cp_kv_allgather",
    "loss",
)
STEP_TERMS = ("step_grads", "optimizer_step")
TERMS = STATE_TERMS + ACTIVATION_TERMS + BUFFER_TERMS + STEP_TERMS
_FWD_BWD_TERMS = ACTIVATION_TERMS + BUFFER_TERMS
FLOPS_CONVENTION = "megatron"


def peak_bytes(terms: dict[str, int]) -> int:
    """The one sum: states + max(forward/backward terms, optimizer-step terms)."""
    get = terms.__getitem__
    step = sum(map(get, STEP_TERMS))
    return sum(map(get, STATE_TERMS)) + max(sum(map(get, _FWD_BWD_TERMS)), step)


class StageEstimate(NamedTuple):
    """Bytes of every term on one rank of pipeline stage ``stage`` (all terms present, zeros included)
    and their peak, ``peak_bytes(terms)``. A NamedTuple, not a frozen dataclass: ``plan`` creates tens
    of thousands, and a frozen dataclass's ``__init__`` costs several times more."""

    stage: int
    terms: dict[str, int]
    total_bytes: int

    @classmethod
    def of(cls, stage: int, terms: dict[str, int]) -> StageEstimate:
        return cls(stage, terms, peak_bytes(terms))


@dataclass(frozen=True)
class Estimate:
    """One configuration's estimate: every stage, the most-loaded one, FLOPs per step."""

    spec: RunSpec
    engine: str
    stages: tuple[StageEstimate, ...]
    flops_per_step: int
    flops_convention: str = FLOPS_CONVENTION
    notes: tuple[str, ...] = field(default=())
    worst: StageEstimate = field(init=False)  # the most-loaded rank

    def __post_init__(self) -> None:
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
        return levels.reserved_terms(self.spec, stage.terms)

    @cached_property
    def _reserved(self) -> tuple[StageEstimate, dict[str, int], int]:
        """(the stage whose reserved level is highest, its reserved terms, that level); computed once:
        ``plan`` asks every candidate for its device level."""
        best = None
        for s in self.stages:
            terms = levels.reserved_terms(self.spec, s.terms)
            total = s.total_bytes + sum(terms.values())
            if best is None or total > best[2]:
                best = (s, terms, total)
        return best

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
        out["utilisation"] = self.utilisation
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


# Two halves of a stage's terms, cached with their partial sums: ``plan`` evaluates tens of thousands
# of layouts that share them (model states do not depend on the training shape, activations not on the
# ZeRO stage or dp). Positional arguments only: lru_cache builds its key faster without keywords.
Items = tuple[tuple[str, int], ...]


@lru_cache(maxsize=65536)
def _state_terms(
    m: ModelSpec,
    stage: int,
    pp: int,
    tp: int,
    shards: int,
    zero: int,
    precision: str,
    engine: str,
    grads_at_peak: str,
) -> tuple[Items, int, int, int]:
    """(items, states sum, forward/backward buffers sum, optimizer-step sum). ``grads_at_peak``: torch's
    :func:`states.torch_grads_at_peak` (megatron keeps its gradient buffer: "kept")."""
    n = stage_params(m, stage=stage, pp=pp, tp=tp)
    if engine == "torch" and shards == 1:
        zero = 0  # the runner wraps nothing for one data-parallel rank: every ZeRO stage is plain AdamW
    if engine == "megatron":
        states = st.megatron_states(n, zero_stage=zero, shards=shards, precision=precision)
    else:
        largest = largest_param(m, stage=stage, pp=pp, tp=tp)
        states = st.torch_states(n, zero_stage=zero, shards=shards, precision=precision, largest=largest)
    step_grads = 0
    if grads_at_peak == "none":  # made in backward, gone after the step: the step's term only
        states["grads"], step_grads = 0, states["grads"]
    elif grads_at_peak == "kept_and_accumulated":  # DDP's buckets and no_sync's own gradients
        states["grads"] *= 2
    elif grads_at_peak == "accumulated" and zero >= 2:
        # FSDP2 accumulates them unsharded, in its reduce dtype: the runner's policy reduces in FP32,
        # and a BF16 gradient is upcast as it is kept (FSDPParam.to_accumulated_grad_if_needed, torch
        # 2.13 _fully_shard/_fsdp_param.py): 4 B per parameter in either precision. Traced: Llama-3.1-
        # 405B, tp 8 × dp 16, ZeRO-3, 8 micro-batches, BF16, rank 0 held 189 GiB of them, where 2 B
        # per parameter (the compute dtype, as counted before) said 94.5.
        states["grads"] = 4 * n
    items = (
        *states.items(),
        (
            "param_copies",
            st.param_copies(
                n,
                zero_stage=zero,
                precision=precision,
                engine=engine,
                replicate=pp > 1 and shards > 1,
                uncast=_uncast_embedding(m, stage=stage, pp=pp, tp=tp),
            ),
        ),
        (
            "fsdp_allgather",
            buf.fsdp_allgather(
                m, stage=stage, pp=pp, tp=tp, zero_stage=zero, precision=precision, engine=engine
            ),
        ),
        ("grad_reduce", buf.grad_reduce(m, tp=tp, zero_stage=zero, shards=shards, engine=engine)),
        ("step_grads", step_grads),
        ("optimizer_step", buf.optimizer_step(n, zero_stage=zero, shards=shards, engine=engine)),
    )
    d = dict(items)
    return (
        items,
        sum(d[k] for k in STATE_TERMS),
        sum(d[k] for k in BUFFER_TERMS if k in d),
        sum(d[k] for k in STEP_TERMS),  # as in peak_bytes
    )


def _uncast_embedding(m: ModelSpec, *, stage: int, pp: int, tp: int) -> int:
    """The embedding's parameters on ``stage``'s rank where autocast leaves them uncast: stage 0's,
    unless the head on the same rank shares the matrix (tied, pp = 1) and its matmul casts it."""
    if stage != 0 or (m.tie_embeddings and pp == 1):
        return 0
    return m.vocab_size * m.hidden_size // tp


@lru_cache(maxsize=65536)
def _activation_terms(
    m: ModelSpec, t: TrainSpec, stage: int, engine: str, layout: tuple
) -> tuple[Items, int]:
    """(items, their sum: all are forward/backward terms)."""
    tp, pp, cp, sp, schedule, v, balance, fused_norm, autocast = layout
    # Activations depend on neither dp nor the ZeRO stage: they are not part of the key.
    p = ParallelSpec(
        dp=1,
        tp=tp,
        pp=pp,
        cp=cp,
        zero_stage=0,
        sequence_parallel=sp,
        pp_schedule=schedule,
        virtual_stages=v,
        cp_load_balance=balance,
    )
    activations = act.stage_layer_activations(
        m, p, t, stage=stage, engine=engine, fused_norm=fused_norm, autocast=autocast
    )
    logits = act.logits(m, p, t, stage=stage, engine=engine)
    loss = buf.loss(m, p, t, stage=stage, engine=engine)
    if engine == "torch" and schedule != "gpipe":  # GPipe keeps every micro-batch's loss buffers
        # The layer recomputed in backward and the loss's buffers are never alive together: backward
        # reaches the layers after the head's gradient is made and the loss buffers are freed, so the
        # peak holds the larger of the two. Measured on the CPU study: full recomputation was
        # over-predicted by ~19 % when both were added.
        working = act.recompute_working_set(m, p, t, engine=engine, fused_norm=fused_norm, autocast=autocast)
        activations -= min(working, logits + loss)
    if engine == "torch":
        # A block's backward gradients: a peak of their own where no loss buffers come first.
        activations += max(0, act.backward_working_set(m, p, t) - logits - loss)
        activations += act.pipeline_stage_outputs(m, p, t, stage=stage, engine=engine, autocast=autocast)
    items = (
        ("activations", activations),
        ("token_ids", act.token_ids(p, t, stage=stage, engine=engine)),
        (
            "output_activations",
            act.output_activations(m, p, t, stage=stage, engine=engine, fused_norm=fused_norm),
        ),
        ("logits", logits),
        ("tp_allgather", buf.tp_allgather(m, p, t, autocast=autocast)),
        ("pp_p2p", buf.pp_p2p(m, p, t, stage=stage, engine=engine, autocast=autocast)),
        ("cp_kv_allgather", buf.cp_kv_allgather(m, p, t, engine=engine)),
        ("loss", loss),
    )
    return items, sum(v for _, v in items)


def _stage(spec: RunSpec, stage: int, engine: str) -> StageEstimate:
    """One stage's terms and peak (= ``peak_bytes(terms)``, from the cached partial sums)."""
    m, p, t = spec.model, spec.parallel, spec.train
    grads = st.torch_grads_at_peak(p, t, stage=stage) if engine == "torch" else "kept"
    s_items, states, buffers, step = _state_terms(
        m, stage, p.pp, p.tp, p.dp * p.cp, p.zero_stage, t.precision, engine, grads
    )
    # On a GPU the runner's RMSNorm is CUDA's fused kernel (activations.norm_tensors).
    fused_norm = spec.device.name != "cpu"
    layout = (
        p.tp,
        p.pp,
        p.cp,
        p.sequence_parallel,
        p.pp_schedule,
        p.virtual_stages,
        p.cp_load_balance,
        fused_norm,
        engine == "torch" and act.torch_autocast(p, t),
    )
    a_items, activations = _activation_terms(m, t, stage, engine, layout)
    terms = dict(s_items + a_items)
    if engine == "torch" and p.zero_stage == 3 and p.dp * p.cp > 1 and stage == p.pp - 1:
        # The head's backward re-gathers the root after the loss's buffers are freed: a peak of its
        # own, counted as what it adds over the loss's (buffers.fsdp_root_regather).
        extra = max(0, buf.fsdp_root_regather(m, p, t, stage=stage) - terms["logits"] - terms["loss"])
        terms["fsdp_allgather"] += extra
        buffers += extra
        # The end of backward, the root's own reduce-scatter: a third candidate peak, the larger one
        # when full recomputation leaves few activations (buffers.fsdp_backward_end).
        end = buf.fsdp_backward_end(m, p, t, stage=stage) - terms["grads"]
        extra = max(0, end - (buffers + activations))
        terms["fsdp_allgather"] += extra
        buffers += extra
    if (
        engine == "torch"
        and stage == 0
        and p.tp > 1
        and (p.dp * p.cp == 1 or (p.zero_stage == 0 and p.pp > 1))
    ):
        states, buffers, step = _replicated_embedding_grad(
            spec, grads, terms, states, buffers, activations, step, fused_norm=fused_norm, autocast=layout[-1]
        )
    return StageEstimate(stage, terms, states + max(buffers + activations, step))


def _replicated_embedding_grad(
    spec: RunSpec,
    grads: str,
    terms: dict[str, int],
    states: int,
    buffers: int,
    activations: int,
    step: int,
    *,
    fused_norm: bool,
    autocast: bool,
) -> tuple[int, int, int]:
    """Stage 0 under tensor parallelism (torch, d·c = 1, or under pipelining any d·c without ZeRO):
    the embedding's gradient is not sharded.

    DTensor has no vocabulary-sharded rule for ``embedding_dense_backward``: the row-parallel
    embedding's gradient comes back replicated, the full v·h matrix in FP32 on every tp rank, and
    stays so as ``.grad`` until the step (``compose.sync_tied_weight`` meets the same). So the
    gradients hold 4·v·h·(1 − 1/t) bytes more than ``stage_params`` says, at the step (``step_grads``)
    or at the peak (``grads``), whichever holds them. And from the second micro-batch on, the
    embedding's backward makes a new full gradient before adding it to the accumulated one: a candidate
    peak at the end of the second backward — all gradients made, a second full embedding gradient,
    the activations of min(inflight − 1, m − 2) micro-batches (1F1B: one more forward runs between
    the first two backwards only when m > inflight). Traced (``run.mode=fake``, Llama-3-70B at 16
    layers, tp 8 × pp 8, m 8): the peak is there, with both 3.91 GiB copies alive; on a real CPU run
    (tiny, tp 2 × pp 2, m 4, BF16) rank 0's measured peak equals the fake trace's. What that candidate
    adds over the forward/backward terms is put in ``grad_reduce`` (0 otherwise for torch): gradient
    memory of backward beyond the states. Without ZeRO the data-parallel wrapper (DDP, ``replicate``)
    gets the same whole gradient: traced on the paper grids' 70B points with d·c = 2 (Llama-3-70B,
    tp 4 × pp 8 × cp 2, stage 0: three whole 3.91 GiB FP32 copies among the temporaries at the peak),
    where the engine, which applied this only at d·c = 1, read 11.5 % under. The third copy is not
    counted here (Llama-3-70B tp 4 × pp 8 with d·c = 2 stays 3.7-5.5 % under). Real CPU runs agree
    under pipelining (the CPU study's tp 2 × pp 2 points with d·c = 2: −0.1 to +1.0 %) but not without
    it: there (tp 2-4 × d·c 2, no pipeline) the measured peaks hold no whole copy, and counting one put
    the engine up to 9 % over, so it is left out. With ZeRO the gradient is reduce-scattered to its
    shard and nothing of this was traced. Mutates ``terms``; returns (states, buffers, step)."""
    m, p, t = spec.model, spec.parallel, spec.train
    full = 4 * m.vocab_size * m.hidden_size
    extra = full - 4 * (m.vocab_size * m.hidden_size // p.tp)
    if grads == "none":
        terms["step_grads"] += extra
        step += extra
    else:
        terms["grads"] += extra
        states += extra
    if t.num_microbatches < 2 or p.pp_schedule == "gpipe" or p.virtual_stages > 1:
        return states, buffers, step
    inflight = act.inflight_chunks(p, t, stage=0)
    held = act.stage_layer_activations(
        m, p, t, stage=0, engine="torch", fused_norm=fused_norm, autocast=autocast
    )
    per_chunk = held // inflight  # (recomputation's working set is small against a chunk; left in)
    freed = inflight - max(0, min(inflight - 1, t.num_microbatches - 2))
    grads_made = 0 if grads != "none" else terms["step_grads"]
    # The blocks' backward working set (in ``activations``, act.backward_working_set) is gone by the
    # embedding's backward, the stage's last.
    working = max(0, act.backward_working_set(m, p, t) - terms["logits"] - terms["loss"])
    candidate = buffers + activations - working - freed * per_chunk + grads_made + full
    more = max(0, candidate - (buffers + activations))
    terms["grad_reduce"] += more
    return states, buffers + more, step


def estimate(spec: RunSpec, *, engine: str = "torch") -> Estimate:
    """Estimate one configuration's per-rank peak memory with ``engine`` (paper, megatron or torch).

    Raises :class:`harness.specs.InvalidSpec` for an impossible layout and ``ValueError`` for an
    unknown engine.
    """
    return estimate_canonical(canonical(spec), engine=engine)


def dominant_stages(p: ParallelSpec, t: TrainSpec) -> tuple[int, ...]:
    """The stages among which the most-loaded one always is: 0, 1, the last, and the first middle
    stage whose peak follows a backward (torch: its gradients are alive then); every stage under
    interleaved 1F1B.

    Stages 1 … pp − 2 hold the same parameters (L/pp layers, no embedding or head), the same buffers
    and no token ids; they differ in in-flight micro-batches, which never grow with the stage index
    (``inflight_chunks``), and in whether the runner's gradients exist at their peak, which once true
    stays true for every later stage (:func:`states.torch_grads_at_peak`). So stage 1 and the first
    stage with gradients bound every middle stage, and the max over these equals the max over all
    stages (a property test checks it).
    """
    pp = p.pp
    if p.pp_schedule == "interleaved_1f1b" and p.virtual_stages > 1:
        # Interleaved 1F1B keeps the sends of a rank's finished backwards until the step ends, more of
        # them the later the rank (buffers.interleaved_sends_kept): no few stages bound the rest.
        return tuple(range(pp))
    stages = {0, min(1, pp - 1), pp - 1}
    for i in range(1, pp - 1):
        if st.torch_grads_at_peak(p, t, stage=i) == "accumulated":
            stages.add(i)
            break
    return tuple(sorted(stages))


def estimate_canonical(
    spec: RunSpec, *, engine: str = "torch", stages: tuple[int, ...] | None = None
) -> Estimate:
    """:func:`estimate` of a spec already returned by :func:`harness.specs.canonical` (no re-validation:
    ``plan`` validates each candidate once). ``stages`` limits the stages computed (``plan`` passes
    :func:`dominant_stages`); by default every stage is."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} must be one of {', '.join(ENGINES)}")
    flops = model_flops_per_step(spec, convention=FLOPS_CONVENTION)
    if engine == "paper":
        terms = dict.fromkeys(TERMS, 0)
        terms.update(paper_terms(spec.model, spec.parallel, spec.train))
        note = "paper: closed form for the first stage; ignores " + ", ".join(IGNORED_FIELDS)
        return Estimate(spec, engine, (StageEstimate.of(0, terms),), flops, notes=(note,))
    ids = range(spec.parallel.pp) if stages is None else stages
    return Estimate(spec, engine, tuple(_stage(spec, i, engine) for i in ids), flops)
