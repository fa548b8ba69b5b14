"""Candidate peaks beyond the one sum, and which stages can hold the most-loaded rank.

A stage's peak is ``states + max(forward/backward, optimizer step)`` (terms.peak_bytes); some ranks
have a later peak of their own that the traces show (the head's re-gather under FSDP2, the end of
backward, a second whole embedding gradient under tensor parallelism). Each is a function here that
says what it adds over the forward/backward terms."""

from __future__ import annotations

from harness.estimate import activations as act
from harness.estimate import buffers as buf
from harness.estimate import pipeline as pipe
from harness.estimate import states as st
from harness.estimate.dtypes import elem_bytes
from harness.estimate.params import layer_params, stage_params
from harness.spec import ModelSpec, ParallelSpec, RunSpec, TrainSpec, stage_kinds


def replicated_embedding_extra(m, tp: int) -> int:
    """What the embedding's gradient holds beyond its 1/t share under tensor parallelism: DTensor has
    no vocabulary-sharded rule for ``embedding_dense_backward``, so it is the whole v·h in FP32,
    4·v·h·(1 − 1/t) bytes more than ``stage_params`` counts (0 without tp)."""
    return 4 * m.vocab_size * m.hidden_size - 4 * (m.vocab_size * m.hidden_size // tp)


def _stage0_embedding_backward(
    spec: RunSpec, terms: dict[str, int], *, fused_norm: bool, autocast: bool
) -> tuple[int, int, int]:
    """(in-flight chunks, one chunk's activations, the blocks' backward working set less the loss's
    buffers) of stage 0 as its embedding's backward, a backward's last op, runs: the working set is
    gone by then, so candidates there take it off the forward/backward terms."""
    m, p, t = spec.model, spec.parallel, spec.train
    inflight = act.inflight_chunks(p, t, stage=0)
    held = act.stage_layer_activations(
        m, p, t, stage=0, engine="torch", fused_norm=fused_norm, autocast=autocast
    )
    working = max(0, act.backward_working_set(m, p, t) - terms["logits"] - terms["loss"])
    return inflight, held // inflight, working


def replicated_embedding_grad(
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
    memory of backward beyond the states. Without ZeRO under a pipeline ``replicate`` (d·c > 1) casts
    BF16 runs' parameters: each backward's whole gradient is in the compute dtype (2·v·h in BF16), the FP32
    one it accumulates into is made from the first and reduced into the shard after the last, gone
    before the step; the peak is the first backward's (its BF16 whole gradient beside the FP32 one it
    becomes, every in-flight chunk's activations but its own). Traced (``run.mode=fake``, stage 0):
    Llama-3-70B tp 4 × pp 8 × cp 2 at 80 layers, 78.99 GiB at the first embedding backward with one
    2,004 MiB BF16 and one 4,008 MiB FP32 whole gradient alive; Llama-3.1-405B at 8 layers, tp 8 × pp 2 ×
    dp 2, full recomputation: the FP32 whole freed before the step's temporaries. Counted as FP32 copies
    at the second backward and at the step before, the paper grids' 134 such stages read −2.3 % to
    +4.2 % (the 405B's step); now −0.1 % to +0.7 %. In FP32 the whole gradient a backward makes is
    the one it accumulates into, and the second backward's candidate above holds. Real CPU runs agree
    under pipelining (the CPU study's tp 2 × pp 2 points with d·c = 2: −0.1 to +1.0 %) but not without
    it: there (tp 2-4 × d·c 2, no pipeline) the measured peaks hold no whole copy, and counting one put
    the engine up to 9 % over, so it is left out. With ZeRO the gradient is reduce-scattered to its
    shard and nothing of this was traced. Mutates ``terms``; returns (states, buffers, step)."""
    m, p, t = spec.model, spec.parallel, spec.train
    # each backward's whole gradient in the parameters' dtype: FP32 under autocast, the compute dtype
    # where ``replicate`` casts them
    full = (4 if autocast else elem_bytes(t.precision)) * m.vocab_size * m.hidden_size
    extra = replicated_embedding_extra(m, p.tp)
    # ``replicate`` casting the parameters to BF16: the whole gradient each backward makes is not the
    # FP32 one it accumulates into (in FP32 the first is the second, as without a wrapper)
    replicate = p.pp > 1 and p.dp * p.cp > 1 and p.zero_stage <= 1 and full < 4 * m.vocab_size * m.hidden_size
    held = 0  # the accumulated whole beyond the shard, where no other term holds it
    if replicate:
        # reduced into its shard by ``replicate`` after the last backward: gone before the step
        if grads != "none":
            terms["grad_reduce"] += extra
            buffers += extra
        else:
            held = extra
    elif grads == "none":
        terms["step_grads"] += extra
        step += extra
    else:
        terms["grads"] += extra
        states += extra
    if t.num_microbatches < 2 or p.pp_schedule == "gpipe" or p.virtual_stages > 1:
        return states, buffers, step
    # (recomputation's working set is small against a chunk; left in the chunk)
    inflight, per_chunk, working = _stage0_embedding_backward(
        spec, terms, fused_norm=fused_norm, autocast=autocast
    )
    # replicate: the first backward's, its BF16 whole gradient beside the FP32 one it becomes, every
    # in-flight chunk's activations but its own (the second backward's holds no more)
    freed = 1 if replicate else inflight - max(0, min(inflight - 1, t.num_microbatches - 2))
    grads_made = 0 if grads != "none" else terms["step_grads"]
    candidate = buffers + activations - working - freed * per_chunk + grads_made + full + held
    candidate += op_recompute_casts(m, p, t, autocast=autocast)
    more = max(0, candidate - (buffers + activations))
    terms["grad_reduce"] += more
    return states, buffers + more, step


def op_recompute_casts(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool) -> int:
    """Under a pipeline with autocast and op recomputation (torchtitan's selective policy), what a
    backward's recomputations cast again by its end: a second BF16 copy of every weight of the stage
    beside the forward's cached one (``states.param_copies``), alive at the embedding's backward, the
    backward's last op. Traced (torchtitan's stack, Llama-3-70B tp 8 × pp 8, d·c = 1, stage 0): the
    tensors the second backward allocated and still held at its embedding backward, the peak, were
    exactly one set of the stage's casts, 30 × 56, 20 × 16 and 20 × 2 MiB (1.99 GiB); the engine read
    3.1 % under without them. Under full recomputation the grids' such stages (1F1B, dp 1) are within
    0.7 % without them, their peaks elsewhere: not counted there."""
    if not autocast or p.pp == 1 or t.recompute != "op" or elem_bytes(t.precision) == 4:
        return 0
    return 2 * layer_params(m, tp=p.tp, ep=p.ep) * (m.num_layers // p.pp)


def sequence_parallel_forward_end(
    spec: RunSpec, stage: int, terms: dict[str, int], buffers: int, *, autocast: bool, gloo: bool
) -> int:
    """A stage before the last under tensor parallelism with sequence parallelism (torch): a candidate
    peak at the end of its last forward, while the last block's down projection is reduce-scattered —
    the row-parallel matmul's full-sequence partial sum (s·b·h/c in the compute dtype), its scattered
    output (/t), and over gloo two full-size copies the collective makes of its input. Every in-flight
    activation is there but the micro-batch's stage output (one boundary) and the backward's working
    set (:func:`activations.backward_working_set`), which the usual candidate counts instead. What it
    adds over the forward/backward terms goes into ``tp_allgather``. Mutates ``terms``; returns the
    forward/backward buffers' new sum.

    Traced on a real CPU run (``small3``, tp 3 × pp 3, BF16, 3 micro-batches): stage 1's peak was
    there, with three BF16 (s, h) tensors and one (s/3, h) beside the activations (2.2 % under without
    it). NCCL's reduce-scatter copies nothing: the partial sum and the output only."""
    m, p, t = spec.model, spec.parallel, spec.train
    e = elem_bytes(t.precision)
    full = e * t.seq_len * t.micro_batch_size * m.hidden_size // p.cp
    working = full * (3 if gloo else 1) + full // p.tp
    instead = act.backward_working_set(m, p, t) + pipe.boundary_bytes(m, p, t, autocast=autocast)
    more = max(0, working - instead)
    terms["tp_allgather"] += more
    return buffers + more


def fsdp_last_stage_peaks(
    spec: RunSpec, stage: int, terms: dict[str, int], buffers: int, activations: int
) -> int:
    """The last stage under FSDP2 (ZeRO-3, d·c > 1): two candidate peaks after the loss, each counted in
    ``fsdp_allgather`` as what it adds over the forward/backward terms. Mutates ``terms``; returns the
    forward/backward buffers' new sum.

    The head's backward re-gathers the root after the loss's buffers are freed (buffers.fsdp_root_regather);
    the end of backward, the root's own reduce-scatter, is the larger one when full recomputation leaves
    few activations (buffers.fsdp_backward_end)."""
    m, p, t = spec.model, spec.parallel, spec.train
    # torchtitan's policy keeps the head's unsharded parameters from its forward through the loss.
    kept = elem_bytes(t.precision) * buf.kept_head(m, p)
    terms["fsdp_allgather"] += kept
    buffers += kept
    gloo = spec.device.name == "cpu"
    # Under the chunked loss the head's backward and reduce-scatter happen inside the loss
    # (buffers.chunked_loss_head), not after it.
    regather = buf.fsdp_root_regather(m, p, t, stage=stage, gloo=gloo) if t.loss_chunks == 1 else 0
    extra = max(0, regather - kept - terms["logits"] - terms["loss"])
    terms["fsdp_allgather"] += extra
    buffers += extra
    end = buf.fsdp_backward_end(m, p, t, stage=stage, gloo=gloo) - terms["grads"]
    extra = max(0, end - (buffers + activations))
    terms["fsdp_allgather"] += extra
    buffers += extra
    extra = max(0, fsdp_block_backward(spec, terms, activations) - (buffers + activations))
    terms["fsdp_allgather"] += extra
    return buffers + extra


def fsdp_block_backward(spec: RunSpec, terms: dict[str, int], activations: int) -> int:
    """A third candidate of :func:`fsdp_last_stage_peaks`, in a block's backward (the forward/backward
    terms it holds then, less what the loss held): the loss's buffers are gone, the block's recomputed
    activations and its backward's working set are alive, and so are three blocks' worth of unsharded
    parameters in the compute dtype — the block's own, copied out of its all-gather, the block before
    it (not yet resharded), and the next block's prefetched all-gather output. It wins where a block's
    parameters outweigh the loss's buffers: a mixture of experts (Mixtral-8x7B's block is 1.45 B
    parameters, 2.7 GiB in BF16). Traced (``run.mode=fake``, Mixtral-8x7B cut to 4 blocks, dp 8,
    ZeRO-3, full recomputation, 8 micro-batches, sequence 8192): at the peak, one block's flat
    all-gather output (2,768 MiB) and 46 of two blocks' 48 BF16 expert matrices beside the unsharded
    FP32 gradients; the engine read 21 % under without it (full size: 2.9 %)."""
    m, p, t = spec.model, spec.parallel, spec.train
    loss_chain = terms["logits"] + terms["loss"]
    working, gradients, counted = act.backward_working_sets(
        m, p, t, loss_chain=loss_chain, fused_norm=spec.device.name != "cpu", autocast=False
    )
    held = activations - loss_chain - counted + working + gradients
    return (
        held
        + 3 * elem_bytes(t.precision) * layer_params(m, tp=p.tp, ep=p.ep)
        + terms["grad_reduce"]
        + terms["param_copies"]
    )


def dominant_stages(p: ParallelSpec, t: TrainSpec, m: ModelSpec | None = None) -> tuple[int, ...]:
    """The stages among which the most-loaded one always is: 0, 1, the last, and the first middle
    stage whose peak follows a backward (torch: its gradients are alive then); every stage under
    interleaved 1F1B.

    Stages 1 … pp − 2 hold the same parameters (L/pp layers, no embedding or head; uneven stages are
    grouped by their block count, parallel.pp_layers), the same buffers
    and no token ids; they differ in in-flight micro-batches, which never grow with the stage index
    (``inflight_chunks``), and in whether the runner's gradients exist at their peak, which once true
    stays true for every later stage (:func:`states.torch_grads_at_peak`). So stage 1 and the first
    stage with gradients bound every middle stage, and the max over these equals the max over all
    stages (a property test checks it).
    """
    pp = p.pp
    if p.pp_schedule == "interleaved_1f1b" and p.virtual_stages > 1:
        # Interleaved 1F1B keeps the sends of a rank's finished backwards until the step ends, more of
        # them the later the rank (pipeline.interleaved_sends_kept): no few stages bound the rest.
        return tuple(range(pp))
    stages = {0, min(1, pp - 1), pp - 1}
    # With uneven stages (parallel.pp_layers) or dense first layers (``m.moe_dense_layers``) the argument
    # holds among the middle stages of one block count and one count of dense blocks: the first of them,
    # and the first of them with its gradients at its peak.
    kinds = stage_kinds(m, p) if m is not None and m.moe and m.moe_dense_layers else None
    groups: dict[tuple, list[int]] = {}
    for i in range(1, pp - 1):
        dense = kinds[i][1] if kinds else 0
        groups.setdefault((p.pp_layers[i] if p.pp_layers else None, dense), []).append(i)
    for group in groups.values():
        stages.add(group[0])
        for i in group:
            if st.torch_grads_at_peak(p, t, stage=i) == "accumulated":
                stages.add(i)
                break
    return tuple(sorted(stages))


def pipeline_first_backward(
    spec: RunSpec,
    stage: int,
    terms: dict[str, int],
    base: int,
    buffers: int,
    activations: int,
    *,
    fused_norm: bool,
    autocast: bool,
) -> int:
    """A pipeline stage whose usual peak comes before any backward (``states.torch_grads_at_peak``
    "none": the end of 1F1B's warm-up with every in-flight micro-batch, GPipe's forwards): a later
    candidate at the end of its first backward, which made every gradient (FP32 and unsharded under
    FSDP2, which reduces after the last one), beside the other micro-batches' activations and kept
    stage outputs — one model chunk fewer than at the warm-up's end — and the same working sets
    (interleaved: at its last backward, which made the last chunk's gradients, beside that chunk's
    activations alone). It wins where the stage's gradients outweigh one chunk: a mixture of experts
    (many parameters, few activations per token) under ``op``; a large dense stage with short
    micro-batches.
    Found on ``tiny_moe``, pp 2, 2 micro-batches, op, FP32 (stage 0 measured 4.3 % above the warm-up
    candidate, at the end of backward with every gradient made), where the last backward and the
    first are one moment. With more micro-batches they are not: Llama-2-70B, tp 4 × pp 8 × cp 2,
    ZeRO-0, 8 micro-batches (the H100 paper grid), stage 0 traced 73,744 MiB with 7 micro-batches'
    activations and 9,161 MiB of gradients at its peak, where this candidate at the last backward
    (one chunk) left the warm-up's 69,398 MiB standing (-5.9 %). What it adds goes into
    ``grad_reduce`` (gradient memory of backward beyond the states, as in
    :func:`replicated_embedding_grad`), and only where it can set the stage's peak: it adds at most the
    gradients, so where the optimizer step's candidate exceeds the forward/backward terms by more, it is
    not computed (``plan`` estimates tens of thousands of layouts). ``base``: the forward/backward
    buffers before any other later candidate (:func:`replicated_embedding_grad`'s, at stage 0 under
    tensor parallelism): this one is a different moment, so it is taken against that sum and adds only
    what it holds above the buffers as they are (the two once stacked, counting the gradients twice:
    Llama-2-7B tp 2 × pp 2 × cp 2, ZeRO-0, stage 0 read 6.3 GiB too high, and more context parallelism
    seemed to cost memory). Mutates ``terms``; returns the forward/backward buffers' new sum."""
    m, p, t = spec.model, spec.parallel, spec.train
    inflight = act.inflight_chunks(p, t, stage=stage)
    if t.num_microbatches * p.virtual_stages < 2 or inflight < 2:
        return buffers
    n = stage_params(m, stage=stage, pp=p.pp, tp=p.tp, ep=p.ep)
    grads = 4 * n if p.zero_stage >= 2 and p.dp * p.cp > 1 else terms["step_grads"]
    if base + activations + grads <= max(
        buffers + activations, terms["step_grads"] + terms["optimizer_step"]
    ):
        return buffers
    working = act.recompute_working_set(m, p, t, engine="torch", fused_norm=fused_norm, autocast=autocast)
    held = act.stage_layer_activations(
        m, p, t, stage=stage, engine="torch", fused_norm=fused_norm, autocast=autocast
    )
    outputs = pipe.pipeline_stage_outputs(m, p, t, stage=stage, engine="torch", autocast=autocast)
    per_chunk = (held - working + outputs) // inflight  # its activations and its kept stage output
    # One model chunk per stage: the first backward makes every gradient and frees one chunk, and no
    # forward follows (the stage's micro-batches are all in flight). Interleaved, a backward makes
    # only its chunk's gradients: every one exists at the last backward, beside its chunk alone.
    freed = 1 if p.virtual_stages == 1 else inflight - 1
    more = max(0, base + grads - freed * per_chunk - buffers)
    terms["grad_reduce"] += more
    return buffers + more


def fsdp_pipeline_first_backward(
    spec: RunSpec,
    terms: dict[str, int],
    base: int,
    buffers: int,
    activations: int,
    *,
    fused_norm: bool,
    autocast: bool,
) -> int:
    """Stage 0 of a pipeline under FSDP2 (ZeRO-2/3, d·c > 1), whose usual peak is the end of 1F1B's
    warm-up: a later candidate at the end of its first backward, where FSDP2, which reduces only after
    the last micro-batch, starts accumulating every gradient unsharded in FP32 — under tensor
    parallelism the embedding's whole v·h (DTensor has no vocabulary-sharded embedding backward,
    :func:`replicated_embedding_grad`) — and the embedding's gradient made in the compute dtype is still
    alive as it is upcast (``FSDPParam.to_accumulated_grad_if_needed``); the blocks are resharded, the
    root (the embedding) gathered, the other in-flight micro-batches' activations kept.
    Traced on a real CPU run (``tiny``, tp 2 × pp 2 × cp 2, ZeRO-3, BF16, 2 micro-batches): stage 0's
    peak is there, a 1 MiB BF16 and a 2 MiB FP32 whole embedding gradient among the FP32 unsharded
    block gradients and the second micro-batch's activations (7.2 % under the warm-up candidate).
    Taken, like :func:`pipeline_first_backward`, against ``base``: what it holds above the buffers as they
    are goes into ``grad_reduce``. Returns the forward/backward buffers' new sum."""
    m, p, t = spec.model, spec.parallel, spec.train
    if t.num_microbatches < 2 or p.pp_schedule == "gpipe" or p.virtual_stages > 1:
        return buffers
    inflight, per_chunk, working = _stage0_embedding_backward(
        spec, terms, fused_norm=fused_norm, autocast=autocast
    )
    if inflight < 2:
        return buffers
    e = elem_bytes(t.precision)
    grads = 4 * stage_params(m, stage=0, pp=p.pp, tp=p.tp, ep=p.ep) + replicated_embedding_extra(m, p.tp)
    made = e * m.vocab_size * m.hidden_size if e < 4 else 0  # upcast beside its FP32 copy
    # ZeRO-3: the blocks are resharded, the embedding gathered again for its backward; ZeRO-2 keeps
    # every unsharded parameter from forward on (``param_copies``, in the buffers already).
    root = e * m.vocab_size * m.hidden_size // p.tp if p.zero_stage == 3 else 0
    candidate = base - terms["fsdp_allgather"] + root + activations - working - per_chunk + grads + made
    more = max(0, candidate - (buffers + activations))
    terms["grad_reduce"] += more
    return buffers + more
