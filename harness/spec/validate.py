"""The single validation of a spec: every reason it cannot run, with the arithmetic in the message."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from harness.spec.types import (
    ATTENTION,
    FSDP_RESHARD,
    GRAD_SYNC,
    MOE_ROUTERS,
    PP_SCHEDULES,
    PRECISIONS,
    RECOMPUTE,
    RECOMPUTE_METHODS,
    RunSpec,
)


def _field_type_problems(spec: Any, section: str) -> list[str]:
    """Fields whose value has the wrong type (a YAML typo shows up here, not deep in the arithmetic)."""
    out = []
    for f in fields(spec):
        value = getattr(spec, f.name)
        allowed = f.type if isinstance(f.type, str) else f.type.__name__
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
        ok = False
        for alt in allowed.replace(" ", "").split("|"):
            if alt == "None" and value is None:
                ok = True
            elif alt == "tuple[int,...]" and isinstance(value, tuple):
                ok = all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            elif alt in kinds and isinstance(value, kinds[alt]):
                # bool is an int in Python; an int field given true/false is a mistake.
                ok = not (alt in ("int", "float") and isinstance(value, bool))
            if ok:
                break
        if not ok:
            out.append(f"{section}.{f.name}={value!r} must be {allowed}")
    return out


def _positive(section: str, spec: Any, names: tuple[str, ...]) -> list[str]:
    values = [getattr(spec, n) for n in names]
    if min(values) >= 1:
        return []
    return [f"{section}.{n}={v} must be >= 1" for n, v in zip(names, values, strict=True) if v < 1]


# Beyond these the arithmetic still runs but a command takes minutes or memory it should not (issue 29:
# pp = 10^6 took 22 s to estimate, plan.max_gpus = 10^12 ran out of memory). Each is far beyond any
# training run: a million ranks; 4,096 pipeline chunks; 65,536 layers; sizes below 2^31.
MAX_RANKS = 2**20
MAX_CHUNKS = 4096
MAX_LAYERS = 65536
MAX_SIZE = 2**31 - 1
MAX_EXPERTS = 65536


def _pp_layers_problems(spec: RunSpec) -> list[str]:
    """``parallel.pp_layers``: one count of blocks per pipeline stage, each at least one and split
    evenly over the stage's virtual chunks, adding up to the model's layers."""
    m, p = spec.model, spec.parallel
    counts, shown = p.pp_layers, "[" + ",".join(map(str, p.pp_layers)) + "]"
    if len(counts) != p.pp:
        return [f"parallel.pp_layers={shown} has {len(counts)} counts for pp = {p.pp} stages (one per stage)"]
    out = []
    if min(counts) < 1:
        out.append(f"parallel.pp_layers={shown}: every stage needs at least 1 block")
    if sum(counts) != m.num_layers:
        out.append(
            f"parallel.pp_layers sum {'+'.join(map(str, counts))} = {sum(counts)} ≠ num_layers {m.num_layers}"
        )
    v = p.virtual_stages if p.virtual_stages >= 1 else 1  # (a virtual_stages < 1 is reported on its own)
    uneven = [f"{c} % {v}" for c in counts if c % v]
    if uneven:
        out.append(
            f"parallel.pp_layers={shown}: each stage's blocks split evenly over its virtual_stages "
            f"{v} chunks ({', '.join(uneven)} ≠ 0)"
        )
    return out


def _moe_problems(spec: RunSpec) -> list[str]:
    """A mixture-of-experts model (``model.num_experts`` > 0): its shape, the routing's imbalance, and the
    layouts the runner does not build for it yet (issue 27), refused here so that the runner, fake runs
    and the estimator refuse them alike."""
    m, p, t = spec.model, spec.parallel, spec.train
    e, k = m.num_experts, m.experts_per_token
    if e < 2:
        return [f"model.num_experts={e}: a mixture of experts needs at least 2 (0: a dense model)"]
    out = []
    if not 1 <= k <= e:
        out.append(f"model.experts_per_token={k} must be from 1 to num_experts {e}")
    if m.moe_ffn_hidden_size < 1:
        out.append(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 with num_experts {e}")
    if m.num_shared_experts < 0:
        out.append(f"model.num_shared_experts={m.num_shared_experts} must be >= 0")
    if m.moe_router not in MOE_ROUTERS:
        out.append(f"model.moe_router={m.moe_router!r} must be one of {', '.join(MOE_ROUTERS)}")
    if not (math.isfinite(m.moe_aux_loss_coeff) and m.moe_aux_loss_coeff >= 0):
        out.append(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be a finite number >= 0")
    if 1 <= k <= e:
        hot = t.moe_imbalance * k
        if not (hot == round(hot) and k <= hot <= e):
            out.append(
                f"train.moe_imbalance={t.moe_imbalance} must make the most-loaded expert's routes among "
                f"every {e} tokens' (moe_imbalance · experts_per_token = {t.moe_imbalance}·{k} = {hot:g}) "
                f"a whole number from {k} (balanced) to {e} (every token)"
            )
    dense = m.moe_dense_layers
    if not 0 <= dense < m.num_layers:
        out.append(
            f"model.moe_dense_layers={dense} must be from 0 to num_layers - 1 = {m.num_layers - 1} "
            "(the first blocks with a dense MLP; every block dense is num_experts=0)"
        )
    elif dense and p.pp > 1 and p.virtual_stages > 1:
        out.append(
            f"model.moe_dense_layers={dense} under interleaved 1F1B (virtual_stages {p.virtual_stages}) is "
            "not built: the estimator counts every chunk of a stage alike"
        )
    return out


def ep_unbuilt(ep: int, shards: int, zero_stage: int, recompute: str) -> bool:
    """Expert-parallel layouts this runner does not build (:func:`ep_runner_problems` says why):
    ZeRO-1, and experts' FSDP2 units of one rank (ep = dp·cp) under op recomputation."""
    return ep > 1 and (zero_stage == 1 or (ep == shards and zero_stage >= 2 and recompute == "op"))


def ep_runner_problems(spec: RunSpec) -> list[str]:
    """Why this runner cannot build an expert-parallel layout (``run`` and ``sweep`` refuse it, real or
    fake; ``plan`` lists it for the ``megatron`` engine only). Not a fault of the spec: Megatron's
    distributed optimizer (its ZeRO-1) shards each expert's states over the ranks that hold it, which
    the ``megatron`` engine judges (``stack=megatron``)."""
    p = spec.parallel
    shards = p.dp * p.cp if p.dp is not None else 0
    if not ep_unbuilt(p.ep, shards, p.zero_stage, spec.train.recompute):
        return []
    if p.zero_stage == 1:
        return [
            f"parallel.ep={p.ep} with zero_stage 1 is not built by this runner: ZeroRedundancyOptimizer "
            "partitions over one group, and the experts' states belong to the dp·cp/ep ranks that share "
            "them (use ZeRO 0, 2 or 3; stack=megatron judges Megatron's distributed optimizer)"
        ]
    # Found by running it: FSDP2's path for a one-rank mesh (each rank alone holds its experts)
    # records profiler ranges inside the checkpointed block that the recomputation does not
    # replay alike, and torch 2.13's selective checkpoint stops at backward.
    return [
        f"parallel.ep={p.ep} = dp·cp with zero_stage {p.zero_stage} and recompute=op is not built by this "
        "runner: the experts' FSDP2 unit would span one rank, which torch 2.13's op-level recomputation "
        "does not replay (use ep < dp·cp, ZeRO-0, or another recompute)"
    ]


def runner_limits(spec: RunSpec) -> list[str]:
    """What this runner does not build of a valid spec (expert parallelism)."""
    return ep_runner_problems(spec)


def _ep_problems(spec: RunSpec) -> list[str]:
    """Expert parallelism: ep groups are carved from the flattened dp·cp ranks, each holding a whole
    share of every block's experts."""
    m, p = spec.model, spec.parallel
    if p.ep == 1:
        return []
    if not m.num_experts:
        return [f"parallel.ep={p.ep} needs a mixture of experts (model.num_experts > 0)"]
    out = []
    if m.num_experts % p.ep:
        out.append(
            f"parallel.ep={p.ep} must divide model.num_experts {m.num_experts} "
            f"({m.num_experts} % {p.ep} = {m.num_experts % p.ep})"
        )
    if p.dp is not None and (p.dp * p.cp) % p.ep:
        out.append(
            f"parallel.ep={p.ep} must divide dp·cp = {p.dp}·{p.cp} = {p.dp * p.cp}: expert-parallel "
            "ranks are data- and context-parallel ranks"
        )
    return out


def _too_large(spec: RunSpec) -> list[str]:
    m, p, t = spec.model, spec.parallel, spec.train
    out = []
    for name, value in (
        ("dp", p.dp),
        ("tp", p.tp),
        ("pp", p.pp),
        ("cp", p.cp),
        ("ep", p.ep),
        ("world_size", p.world_size),
    ):
        if value is not None and value > MAX_RANKS:
            out.append(f"parallel.{name}={value} is over {MAX_RANKS:,} ranks")
    if p.pp * p.virtual_stages > MAX_CHUNKS:
        out.append(f"pp·virtual_stages = {p.pp * p.virtual_stages:,} pipeline chunks is over {MAX_CHUNKS:,}")
    if m.num_layers > MAX_LAYERS:
        out.append(f"model.num_layers={m.num_layers:,} is over {MAX_LAYERS:,}")
    if m.num_experts > MAX_EXPERTS:
        out.append(f"model.num_experts={m.num_experts:,} is over {MAX_EXPERTS:,}")
    for section, obj, names in (
        (
            "model",
            m,
            (
                "hidden_size",
                "ffn_hidden_size",
                "vocab_size",
                "num_heads",
                "num_kv_heads",
                "moe_ffn_hidden_size",
                "head_dim",
            ),
        ),
        ("train", t, ("seq_len", "micro_batch_size", "num_microbatches", "steps")),
    ):
        for name in names:
            value = getattr(obj, name)
            if value is not None and value > MAX_SIZE:
                out.append(f"{section}.{name}={value:,} is over {MAX_SIZE:,}")
    return out


def type_problems(spec: RunSpec) -> list[str]:
    """Fields of ``spec`` whose value has the wrong type."""
    return [
        reason
        for section in ("model", "parallel", "train", "device")
        for reason in _field_type_problems(getattr(spec, section), section)
    ]


def problems(spec: RunSpec) -> list[str]:
    """Every reason why ``spec`` cannot run, each with the arithmetic that shows it (empty if valid)."""
    # Arithmetic on wrongly typed values would only add noise.
    return type_problems(spec) or layout_problems(spec)


def layout_problems(spec: RunSpec) -> list[str]:
    """:func:`problems` for a spec whose fields are known to have the right types (``plan`` checks the
    types of its base spec once, then the arithmetic of each candidate)."""
    m, p, t = spec.model, spec.parallel, spec.train
    microbatches = p.pp if t.num_microbatches is None else t.num_microbatches
    out = _positive(
        "model",
        m,
        ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"),
    )
    out += _positive("parallel", p, ("tp", "pp", "cp", "ep", "virtual_stages"))
    out += _positive("train", t, ("seq_len", "micro_batch_size", "steps", "recompute_every"))
    if isinstance(t.steps, int) and t.steps == 1:
        out.append(
            "train.steps=1 must be >= 2 (a warm-up step: AdamW state appears at the first; then timed steps)"
        )
    if t.num_microbatches is not None and t.num_microbatches < 1:
        out.append(f"train.num_microbatches={t.num_microbatches} must be >= 1 (or null: one per stage)")
    if p.dp is not None and p.dp < 1:
        out.append(f"parallel.dp={p.dp} must be >= 1")
    if p.world_size is not None and p.world_size < 1:
        out.append(f"parallel.world_size={p.world_size} must be >= 1")
    gib = spec.device.memory_gib
    if not 0 < gib < float("inf"):
        out.append(f"device.memory_gib={gib} must be a finite number of GiB > 0")
    elif gib * 2**30 < 2**20:
        out.append(f"device.memory_gib={gib} is under 1 MiB ({gib * 2**30:.3g} bytes)")
    out += _too_large(spec)
    if out:
        return out

    # Model shape.
    if m.head_dim is not None and m.head_dim < 1:
        out.append(f"model.head_dim={m.head_dim} must be >= 1 (or null: hidden_size / num_heads)")
    elif m.head_dim is None and m.hidden_size % m.num_heads:
        out.append(
            f"hidden_size {m.hidden_size} % num_heads {m.num_heads} = {m.hidden_size % m.num_heads} ≠ 0"
        )
    if m.num_heads % m.num_kv_heads:
        out.append(f"num_heads {m.num_heads} % num_kv_heads {m.num_kv_heads} ≠ 0 (GQA groups must be whole)")

    # Degrees against the world size.
    rest = p.tp * p.pp * p.cp
    if p.dp is None:
        if p.world_size is None:
            out.append("parallel.dp is null and parallel.world_size is not set: one of them is needed")
        elif p.world_size % rest:
            out.append(
                f"world_size {p.world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp} = {rest}"
            )
    elif p.world_size is not None and p.dp * rest != p.world_size:
        out.append(f"dp·tp·pp·cp = {p.dp}·{p.tp}·{p.pp}·{p.cp} = {p.dp * rest} ≠ world_size {p.world_size}")

    # Tensor parallel shards heads, KV heads and the vocabulary.
    for what, n in (
        ("num_heads", m.num_heads),
        ("num_kv_heads", m.num_kv_heads),
        ("ffn_hidden_size", m.ffn_hidden_size),
        ("vocab_size", m.vocab_size),
    ):
        if n % p.tp:
            out.append(f"{what} {n} % tp {p.tp} = {n % p.tp} ≠ 0")

    # Pipeline: whole layers per (virtual) stage, enough micro-batches to fill the schedule.
    if p.pp_schedule not in PP_SCHEDULES:
        out.append(f"parallel.pp_schedule={p.pp_schedule!r} must be one of {', '.join(PP_SCHEDULES)}")
    chunks = p.pp * p.virtual_stages
    if p.pp_layers:
        out += _pp_layers_problems(spec)
    elif m.num_layers % chunks:
        out.append(
            f"num_layers {m.num_layers} % (pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks}) "
            f"= {m.num_layers % chunks} ≠ 0 (uneven stages: parallel.pp_layers, one count per stage)"
        )
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved_1f1b":
        out.append(
            f"virtual_stages {p.virtual_stages} > 1 needs pp_schedule=interleaved_1f1b, not {p.pp_schedule}"
        )
    if p.pp_schedule == "interleaved_1f1b":
        if p.virtual_stages < 2:
            out.append("pp_schedule=interleaved_1f1b needs virtual_stages >= 2 (with 1 it is plain 1f1b)")
        if p.pp < 2:
            out.append("pp_schedule=interleaved_1f1b needs pp >= 2")
        elif microbatches % p.pp:
            # Megatron's rule; torch's Interleaved1F1B accepts a few more counts, but the in-flight
            # accounting of the estimator (Narayanan et al. 2021) assumes whole rounds.
            out.append(
                f"interleaved_1f1b needs num_microbatches % pp = 0: {microbatches} % {p.pp} "
                f"= {microbatches % p.pp}"
            )
    if p.pp > 1 and p.pp_schedule == "1f1b" and microbatches < p.pp:
        out.append(f"1f1b needs num_microbatches >= pp: {microbatches} < {p.pp}")

    # Context parallel splits the sequence (in 2·cp chunks when head–tail load-balanced), sequence
    # parallel splits each context shard again by tp.
    cp_chunks = 2 * p.cp if (p.cp > 1 and p.cp_load_balance) else p.cp
    if t.seq_len % cp_chunks:
        how = "2·cp" if cp_chunks != p.cp else "cp"
        out.append(f"seq_len {t.seq_len} % ({how} = {cp_chunks}) = {t.seq_len % cp_chunks} ≠ 0")
    elif p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        out.append(
            f"sequence parallel needs (seq_len/cp) % tp = 0: ({t.seq_len}/{p.cp}) % {p.tp} "
            f"= {(t.seq_len // p.cp) % p.tp}"
        )

    if not isinstance(t.loss_chunks, int) or t.loss_chunks < 1:
        out.append(f"train.loss_chunks={t.loss_chunks!r} must be an integer >= 1")
    elif (tokens := t.micro_batch_size * t.seq_len // p.cp) % t.loss_chunks:
        out.append(
            f"train.loss_chunks={t.loss_chunks} must divide a rank's tokens per micro-batch, "
            f"micro_batch_size·seq_len/cp = {tokens} ({tokens} % {t.loss_chunks} = {tokens % t.loss_chunks})"
        )

    if m.num_experts:
        out += _moe_problems(spec)
    out += _ep_problems(spec)
    if m.qk_norm and p.tp > 1:
        out.append(
            f"tensor parallelism with qk_norm (Qwen3's query and key norms) is not built yet: tp {p.tp}"
        )

    if p.zero_stage not in (0, 1, 2, 3):
        out.append(f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    for name, value, allowed in (
        ("train.recompute", t.recompute, RECOMPUTE),
        ("train.recompute_method", t.recompute_method, RECOMPUTE_METHODS),
        ("train.precision", t.precision, PRECISIONS),
        ("train.attention", t.attention, ATTENTION),
        ("train.grad_sync", t.grad_sync, GRAD_SYNC),
        ("parallel.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, FSDP_RESHARD),
    ):
        if value not in allowed:
            out.append(f"{name}={value!r} must be one of {', '.join(allowed)}")
    return out
