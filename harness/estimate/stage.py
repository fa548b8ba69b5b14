"""One pipeline stage's terms, composed from the term functions (states, activations, buffers) and the
candidate peaks of harness/estimate/peaks.py; cached in two halves for ``plan``."""

from __future__ import annotations

from functools import lru_cache

from harness.estimate import activations as act
from harness.estimate import buffers as buf
from harness.estimate import pipeline as pipe
from harness.estimate import states as st
from harness.estimate.dtypes import elem_bytes, torch_autocast
from harness.estimate.params import expert_params, param_numels, stage_params, zero1_partitions
from harness.estimate.peaks import (
    fsdp_last_stage_peaks,
    fsdp_pipeline_first_backward,
    pipeline_first_backward,
    replicated_embedding_extra,
    replicated_embedding_grad,
    sequence_parallel_forward_end,
)
from harness.estimate.terms import BUFFER_TERMS, STATE_TERMS, STEP_TERMS, StageEstimate
from harness.spec import ModelSpec, ParallelSpec, RunSpec, TrainSpec

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
    ep: int = 1,
) -> tuple[Items, int, int, int]:
    """(items, states sum, forward/backward buffers sum, optimizer-step sum). ``grads_at_peak``: torch's
    :func:`states.torch_grads_at_peak` (megatron keeps its gradient buffer: "kept"). ``ep``: expert
    parallelism — the rank holds 1/ep of the experts, sharded over dp·cp/ep ranks (so its shard of them
    is the whole stage's / dp·cp, as without it)."""
    n = stage_params(m, stage=stage, pp=pp, tp=tp, ep=ep)
    whole = stage_params(m, stage=stage, pp=pp, tp=tp)
    if engine == "torch" and shards == 1:
        zero = 0  # the runner wraps nothing for one data-parallel rank: every ZeRO stage is plain AdamW
    partition = 0
    if engine == "torch" and zero == 1:
        partition = max(zero1_partitions(param_numels(m, stage=stage, pp=pp, tp=tp), shards))
    if engine == "megatron":
        states = st.megatron_states(n, zero_stage=zero, shards=shards, precision=precision, sharded=whole)
    else:
        states = st.torch_states(
            n, zero_stage=zero, shards=shards, precision=precision, partition=partition, sharded=whole
        )
    step_grads = unsharded = 0
    if grads_at_peak == "none":  # made in backward, gone after the step: the step's term only
        states["grads"], step_grads = 0, states["grads"]
    elif grads_at_peak == "kept_and_accumulated":  # DDP's buckets and no_sync's own gradients
        # (the experts', which DDP ignores under expert parallelism, have no bucket)
        states["grads"] += (
            4 * (n - expert_params(m, stage=stage, pp=pp, ep=ep, tp=tp)) if ep > 1 else states["grads"]
        )
    elif grads_at_peak == "accumulated" and zero >= 2:
        # FSDP2 accumulates them unsharded, in its reduce dtype: the runner's policy reduces in FP32,
        # and a BF16 gradient is upcast as it is kept (FSDPParam.to_accumulated_grad_if_needed, torch
        # 2.13 _fully_shard/_fsdp_param.py): 4 B per parameter in either precision. Traced: Llama-3.1-
        # 405B, tp 8 × dp 16, ZeRO-3, 8 micro-batches, BF16, rank 0 held 189 GiB of them, where 2 B
        # per parameter (the compute dtype, as counted before) said 94.5. The last backward
        # reduce-scatters them to their FP32 shards before the optimizer step: the shard is the state,
        # the rest a forward/backward term (``grad_reduce``), not on the step's side. Traced:
        # Llama-3-70B tp 8 × dp 4, ZeRO-3, full recomputation, 64.90 GiB at the second micro-batch,
        # where the step's candidate over every unsharded gradient read 69.77 (+7.5 %).
        unsharded = 4 * n - states["grads"]
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
                m, stage=stage, pp=pp, tp=tp, zero_stage=zero, precision=precision, engine=engine, ep=ep
            ),
        ),
        ("grad_reduce", buf.grad_reduce(m, tp=tp, zero_stage=zero, shards=shards, engine=engine) + unsharded),
        ("step_grads", step_grads),
        (
            "optimizer_step",
            buf.optimizer_step(
                whole if zero >= 2 else n, zero_stage=zero, shards=shards, engine=engine, partition=partition
            ),
        ),
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
    tp, pp, cp, sp, schedule, v, balance, ep, fused_norm, gloo, autocast = layout
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
        ep=ep,
    )
    activations = act.stage_layer_activations(
        m, p, t, stage=stage, engine=engine, fused_norm=fused_norm, autocast=autocast
    )
    logits = act.logits(m, p, t, stage=stage, engine=engine)
    loss = buf.loss(m, p, t, stage=stage, engine=engine)
    if engine == "torch" and t.loss_chunks > 1 and stage == p.pp - 1:
        logits, loss = buf.chunked_loss(m, p, t)
    if engine == "torch":
        # The recomputed block and a block's gradients are never alive with the loss's buffers: backward
        # reaches the blocks after the head's gradient is made and the loss buffers are freed.
        # (stage_layer_activations counted the recomputed block whole.)
        working, _, counted = act.backward_working_sets(
            m, p, t, loss_chain=logits + loss, fused_norm=fused_norm, autocast=autocast
        )
        activations += counted - working
        activations += pipe.pipeline_stage_outputs(m, p, t, stage=stage, engine=engine, autocast=autocast)
        activations -= pipe.received_input_saved(
            m, p, t, stage=stage, engine=engine, fused_norm=fused_norm, autocast=autocast
        )
    items = (
        ("activations", activations),
        ("token_ids", act.token_ids(p, t, stage=stage, engine=engine)),
        (
            "output_activations",
            act.output_activations(
                m, p, t, stage=stage, engine=engine, fused_norm=fused_norm, autocast=autocast
            ),
        ),
        ("logits", logits),
        ("tp_allgather", buf.tp_allgather(m, p, t, autocast=autocast)),
        ("pp_p2p", pipe.pp_p2p(m, p, t, stage=stage, engine=engine, autocast=autocast, gloo=gloo)),
        ("cp_kv_allgather", buf.cp_kv_allgather(m, p, t, engine=engine)),
        ("loss", loss),
    )
    return items, sum(v for _, v in items)


def forward_end(
    spec: RunSpec, terms: dict[str, int], buffers: int, activations: int, casts: int, fused_norm: bool
) -> tuple[int, int]:
    """Without a pipeline, under autocast with full or op recomputation (torch): the peak is the
    larger of two. The backward's, the terms as counted, less the checkpointed blocks' casts, which
    autocast's cache dropped when the forward's region closed (:func:`act.checkpointed_casts`). Or the
    forward's end, inside that region: every cast alive, the layers' kept activations without the
    backward's working sets (the recomputed block's, :func:`act.recompute_working_set`, and a block's
    gradients, :func:`act.backward_working_set`, where they exceed the loss's buffers), the loss's
    forward chain (:func:`buf.forward_end_loss_chain`) instead of its backward one. Traced
    (``run.mode=fake``, Llama-3-8B, one rank per 8 on an H100, ZeRO-1): at tp 1, s 2048, op, the
    forward's end with all 32 blocks' casts, 12 % above the backward-only figure, to 0.01 % (full at
    8 blocks: to 0.01 %); at tp 1, s 8192, op, the forward's end too (Llama-3-8B and Llama-2-13B,
    8 % and 11 % under without it). Under tensor parallelism no cast of a DTensor weight was alive at
    the peak (tp 2, 8 blocks, full at s 2048: the MLP weights' 56 MiB casts absent; tp 2-4 at s 8192,
    op: the backward's figure within 2.4 %), so there the backward's peak stands.
    Mutates ``terms``; returns (buffers, activations)."""
    m, p, t = spec.model, spec.parallel, spec.train
    loss_chain = terms["logits"] + terms["loss"]
    _, _, backward_only = act.backward_working_sets(
        m, p, t, loss_chain=loss_chain, fused_norm=fused_norm, autocast=True
    )
    logits, loss = buf.forward_end_loss_chain(m, p, t)
    saved = loss_chain - logits - loss + backward_only  # what the forward's end does not hold
    if p.tp > 1 or casts <= saved:  # the backward's peak
        terms["param_copies"] -= casts
        return buffers - casts, activations
    terms.update(logits=logits, loss=loss, activations=terms["activations"] - backward_only)
    return buffers, activations - saved


def fsdp_replicated_embedding_grad(spec: RunSpec, terms: dict[str, int]) -> int:
    """Stage 0 (the embedding's), under tensor parallelism and FSDP2 (ZeRO-2/3) accumulating unsharded
    gradients across micro-batches (``train.grad_sync=last``, which every pipeline is:
    ``spec.identity.canonical_grad_sync``; ``states.torch_grads_at_peak``: "accumulated"), the layouts
    traced. DTensor has no vocabulary-sharded rule for the embedding's backward
    (``peaks.replicated_embedding_grad``), so the gradient FSDP2 accumulates for the embedding is the
    whole v·h matrix in FP32, not its 1/t shard, from the first micro-batch's backward to the last
    one's reduce-scatter. Traced (``run.mode=fake``, Llama-3-8B tp 4 × dp 2,
    ZeRO-3, op, s 8192, 8 micro-batches): a 2,004 MiB FP32 block at the peak where the shard is
    501 MiB; the engine read 4.6 % under without it. ZeRO-2 (FSDP2 without resharding after forward)
    accumulates the same way: a real CPU run (``small``, tp 2 × dp 2, BF16, 2 micro-batches) measured
    4.5 % above the engine without it, 0.07 % below with it (found by the property that a higher ZeRO
    stage never costs memory: ZeRO-3 had it and ZeRO-2 not). Under a pipeline the same, torchtitan's
    default stack included (its schedules reduce after the last micro-batch): traced Llama-3-70B tp 8
    × pp 4 × dp 2, op, s 8192, 8 micro-batches, stage 0 holds a 4,008 MiB FP32 block from the first
    backward to the step (traced 50.62 GiB; the engine 7.1 % under without it, 0.3 % with it). Not
    counted where gradients are reduced every micro-batch without a pipeline (torchtitan's default
    there: FSDP2 reduce-scatters each micro-batch's whole gradient at once). Mutates ``terms``
    (``grad_reduce``); returns the bytes added."""
    m, p = spec.model, spec.parallel
    extra = replicated_embedding_extra(m, p.tp)
    terms["grad_reduce"] += extra  # (unsharded, like the rest: gone by the optimizer step)
    return extra


def stage_estimate(spec: RunSpec, stage: int, engine: str) -> StageEstimate:
    """One stage's terms and peak (= ``peak_bytes(terms)``, from the cached partial sums)."""
    m, p, t = spec.model, spec.parallel, spec.train
    grads = st.torch_grads_at_peak(p, t, stage=stage) if engine == "torch" else "kept"
    s_items, states, buffers, step = _state_terms(
        m, stage, p.pp, p.tp, p.dp * p.cp, p.zero_stage, t.precision, engine, grads, p.ep
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
        p.ep,
        fused_norm,
        spec.device.name == "cpu",  # gloo's works hold their tensors (pipeline.one_f_one_b_sends_kept)
        engine == "torch" and torch_autocast(p, t),
    )
    a_items, activations = _activation_terms(m, t, stage, engine, layout)
    terms = dict(s_items + a_items)
    if engine == "torch" and layout[-1]:
        casts = act.checkpointed_casts(m, p, t, autocast=True)
        if casts:
            buffers, activations = forward_end(spec, terms, buffers, activations, casts, fused_norm)
    if engine == "torch" and t.loss_chunks > 1 and stage == p.pp - 1:
        chain = terms["logits"] + terms["loss"] - buf.chunked_loss_hidden_grad(m, p, t)
        head = buf.chunked_loss_head(m, p, t, grads, chain)
        terms["loss"] += head
        buffers += head
        if p.zero_stage == 2 and p.dp * p.cp > 1 and p.pp == 1 and not m.tie_embeddings:
            # The root (the embedding) is resharded at the first slice's backward (traced: its BF16
            # copy freed there, gathered again when the blocks' backward reaches the norm)
            root = elem_bytes(t.precision) * (m.vocab_size * m.hidden_size // p.tp)
            terms["param_copies"] -= root
            buffers -= root
    if engine == "torch":
        tables = st.rotary_tables(m.num_layers // p.pp, seq_len=t.seq_len, cp=p.cp, head_dim=m.head_size)
        terms["params"] += tables
        states += tables
    if engine == "torch" and p.tp > 1 and p.sequence_parallel and stage < p.pp - 1:
        buffers = sequence_parallel_forward_end(
            spec, stage, terms, buffers, autocast=layout[-1], gloo=spec.device.name == "cpu"
        )
    if engine == "torch" and p.zero_stage == 3 and p.dp * p.cp > 1 and stage == p.pp - 1:
        buffers = fsdp_last_stage_peaks(spec, stage, terms, buffers, activations)
    if (
        engine == "torch"
        and p.tp > 1
        and stage == 0
        and p.zero_stage >= 2
        and t.grad_sync == "last"
        and grads == "accumulated"
    ):
        buffers += fsdp_replicated_embedding_grad(spec, terms)
    base = buffers  # the forward/backward buffers before the later backward's candidates
    if (
        engine == "torch"
        and stage == 0
        and p.tp > 1
        and (p.dp * p.cp == 1 or (p.zero_stage == 0 and p.pp > 1))
    ):
        states, buffers, step = replicated_embedding_grad(
            spec, grads, terms, states, buffers, activations, step, fused_norm=fused_norm, autocast=layout[-1]
        )
    if (
        engine == "torch"
        and stage == 0
        and p.pp > 1
        and p.zero_stage >= 2
        and p.dp * p.cp > 1
        and grads == "none"
    ):
        buffers = fsdp_pipeline_first_backward(
            spec, terms, base, buffers, activations, fused_norm=fused_norm, autocast=layout[-1]
        )
    if engine == "torch" and p.pp > 1 and grads == "none":
        # A candidate of its own, against the same terms as the replicated embedding's: the larger wins.
        buffers = pipeline_first_backward(
            spec, stage, terms, base, buffers, activations, fused_norm=fused_norm, autocast=layout[-1]
        )
    return StageEstimate(stage, terms, states + max(buffers + activations, step))
