"""Activation memory: per layer, per pipeline stage with in-flight micro-batches, and the stage's ends.

ESTIMATOR.md §3. Sizes are per micro-batch of b sequences of s tokens, on one rank, in bytes; e is
the compute dtype's element size (2 for BF16, 4 for FP32). Stored per Llama layer, in elements, before
any sharding (Korthikanti et al. 2022, arXiv 2205.05198, §4, adapted: no dropout, GQA, SwiGLU):

  two RMSNorm inputs            2·sbh
  attention input (QKV input)     sbh
  Q and attention output        2·sbh
  K and V                       2·sbh·k/a
  MLP input                       sbh
  gate, up, silu(gate), product 4·sbf
  softmax (math only)             a·s²·b, and K, V repeated to a heads: 2·sbh·(1 − k/a)

which at e = 2 is the ESTIMATOR's s·b·h·(12 + 4k/a + 8f/h) (Llama-3-8B: 41.0) plus 2as²b (the
softmax output, Korthikanti's 5as²b without dropout's 3as²b; issue 15: the runner now runs the math
kernel, which showed that the scores before the softmax are not kept). Worked
example, model ``tiny`` (h 128, a 4, k 2, f 352), s 256, b 2, BF16, t = c = 1: sbh = 65,536 elements;
norms 131,072 + input 65,536 + Q/out 131,072 + K/V 65,536 + MLP input 65,536 + 4·sbf 720,896
= 1,179,648 elements = 2,359,296 B (= sbh·e·(12 + 4·0.5 + 8·2.75)/2 = 65,536·2·18).

Sharding by tensor (t) and context (c) parallelism:
- megatron, SP: every part / (t·c) (Korthikanti Table 2, "tensor + sequence parallel").
- megatron, no SP: norm, attention and MLP inputs / c only, the rest / (t·c) (Table 2, Llama form of
  sbh(10 + 24/t): sbh·(8 + (4 + 4k/a + 8f/h)/t) bytes at e = 2).
- torch: the runner's DTensor plan (torchtitan's) all-gathers the sequence-sharded input before the
  column-parallel projections and autograd saves that full tensor, so attention and MLP inputs are
  / c only even with SP; its all-gather-KV context parallelism saves the gathered, full-sequence K and
  V, so K and V are / t only. Its ``F.rms_norm`` saves the normalised tensor (for the weight's
  gradient) beside the input: 2·sbh per norm, 4·sbh per layer (found with saved-tensor hooks on the
  ``small`` model: 9.89 MiB per layer at s 512, b 1, FP32, 1.02 MiB above the 2·sbh count; fused
  RMSNorm kernels such as Apex's, which Megatron uses, keep the input and 1/rms only).
- Softmax (math attention): (s/c)·s per head, a/t heads.
"""

from __future__ import annotations

from harness.estimate.attention import math_attention_bytes, rope_table_bytes
from harness.estimate.checkpoints import checkpointed_layers, covered_blocks
from harness.estimate.dtypes import elem_bytes, norm_elem_bytes, norm_tensors
from harness.estimate.moe import (
    megatron_moe_layer_bytes,
    moe_backward_working_set,
    moe_layer_bytes,
    moe_op_bytes,
)
from harness.estimate.params import layer_params
from harness.spec import ModelSpec, ParallelSpec, TrainSpec


def layer_activation_bytes(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    engine: str,
    recompute: str | None = None,
    fused_norm: bool = False,
    autocast: bool = False,
) -> int:
    """Bytes one layer keeps for backward for one micro-batch on one rank, under ``recompute`` (default
    ``t.recompute``): "none" (and the blocks that full recomputation with ``recompute_every`` > 1 leaves
    alone) keeps everything; "selective" drops the attention kernel's extra tensors — Korthikanti's
    selective recomputation of the attention core, which with flash attention saves only its tiny
    log-sum-exp, left out here; "op" keeps what torchtitan's op policy saves (:func:`op_layer_bytes`).

    ``autocast`` (torch, :func:`torch_autocast`): the residual stream stays FP32 (the embedding and
    the norms run on FP32 weights), so the norms keep FP32 tensors, and every linear casts its FP32
    input to BF16 itself — autocast caches casts of leaf parameters only — and its matmul keeps that
    cast: Q, K and V each keep one of the attention input, the gate and up projections each one of the
    MLP input, 5·sbh BF16 per layer where one copy of each input (2·sbh) is counted otherwise. Traced
    (``run.mode=fake``, Llama-3-70B at 16 layers, tp 8 × pp 8, BF16, stage 0): 60 BF16 (s, h) casts
    for 6 micro-batches × 2 layers, and FP32 norm inputs; a real CPU run of the same kind (tiny, tp 2
    × pp 2) measures what the fake trace does."""
    recompute = t.recompute if recompute is None else recompute
    if recompute == "full":
        recompute = "none"
    if recompute == "op":
        return op_layer_bytes(m, p, t, autocast=autocast)
    s, b, h, f = t.seq_len, t.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    sbh = s * b * h
    tc = p.tp * p.cp
    sp = p.sequence_parallel and p.tp > 1
    norm = norm_tensors(engine, fused_norm=fused_norm) * sbh // (tc if sp else p.cp)
    inputs_div = tc if (sp and engine == "megatron") else p.cp
    inputs = 2 * sbh // inputs_div  # attention input + MLP input
    q_out = 2 * s * b * m.q_width // tc  # Q and the attention output: a·d wide (h unless head_dim)
    kv_elems = 2 * s * b * m.kv_width
    # Qwen3's query and key norms keep what a norm keeps (norm_tensors / 2 each) of Q and K
    qk = (
        norm_tensors(engine, fused_norm=fused_norm) // 2 * s * b * (m.q_width + m.kv_width) // tc
        if m.qk_norm
        else 0
    )
    kv_div = p.tp if engine == "torch" else tc
    kv = kv_elems // kv_div
    math = 0
    if t.attention == "math" and recompute == "none":
        math = math_attention_bytes(m, p, t, kv_div=kv_div, engine=engine)
    mask = 0
    if engine == "torch" and p.cp > 1 and recompute == "none" and t.attention == "flash":
        # The all-gather-KV attention passes SDPA a boolean causal mask (local queries × all keys);
        # SDPA converts it to the compute dtype and saves that copy for backward, in every layer: (s/c)·s
        # elements, shared by the batch and the heads (measured: +34.9 MiB on tiny, cp 2, s 2048, 4
        # layers of 8 MiB plus the boolean mask; growing with s² as it should). The math kernel adds
        # the converted mask to its scores and keeps neither.
        mask = (s // p.cp) * s
    mlp = 4 * s * b * f // tc
    norm_elem = norm_elem_bytes(t, engine=engine, fused_norm=fused_norm, autocast=autocast)
    if autocast:
        inputs = 5 * sbh // inputs_div  # Q, K, V; gate, up: one BF16 cast each
    moe = 0
    if m.moe:  # the MLP is a mixture of experts: its input and what it keeps (harness/estimate/moe.py)
        inputs, mlp = inputs - (2 if autocast else 1) * sbh // inputs_div, 0
        if engine == "megatron":
            moe = megatron_moe_layer_bytes(m, p, t)
        else:
            moe = moe_layer_bytes(m, p, t, autocast=autocast)
    rope = rope_table_bytes(m, p, t) if engine == "torch" else 0
    return (
        elem_bytes(t.precision) * (inputs + q_out + kv + mlp + mask)
        + math
        + norm_elem * (norm + qk)
        + rope
        + moe
    )


def op_layer_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool = False) -> int:
    """A layer under torchtitan's op-level policy (``harness/runner/parallel/recompute.py``): the
    block's input, which the checkpoint keeps, and the outputs of the ops on the save list
    (:func:`op_kept_elements`). In elements, for t = c = 1: sbh·(3 + k/a) + sbf (+ sbh for the flash
    output); measured on one ``tiny`` block (s 512, b 4, FP32): 7.28 sbh kept, against
    1 + 1 + 0.5 + 1 + 2.75 + 1 = 7.25 plus the log-sum-exp."""
    moe = moe_op_bytes(m, p, t) if m.moe else 0  # the MLP's matmuls are the router's and the experts'
    return (
        layer_input_bytes(m, p, t, autocast=autocast)
        + elem_bytes(t.precision) * sum(op_kept_elements(m, p, t))
        + moe
    )


def op_kept_elements(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> tuple[int, ...]:
    """The outputs of the ops on torchtitan's op save list (elements, one rank), in the order a block's
    forward makes them: the 1st, 3rd, 5th and 7th of the block's 7 matmuls (wq, wv, w1, w2; wk, wo
    and w3 are every second one, recomputed), the fused attention kernel's output (the math kernel is
    not one op: its matmuls and softmax are recomputed) and, with sequence parallelism, the two
    reduce-scatters' outputs: wq, wv, attention, [reduce-scatter], w1, w2, [reduce-scatter]. The
    block's input, which the checkpoint keeps, is :func:`layer_input_bytes`.

    Sharding: column-parallel outputs and the attention output by t·c; w2's output is the
    row-parallel matmul's un-reduced partial sum, full width on every tp rank, by c only. Under a
    mixture of experts w1's and w2's are the experts' (harness/estimate/moe.py), 0 here."""
    s, b, h, f = t.seq_len, t.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    sbh = s * b * h
    tc = p.tp * p.cp
    q = s * b * m.q_width // tc
    v = s * b * m.kv_width // tc
    attention = s * b * m.q_width // tc if t.attention == "flash" else 0
    gate, down = (0, 0) if m.moe else (s * b * f // tc, sbh // p.cp)
    reduce_scatter = (sbh // tc,) if p.sequence_parallel and p.tp > 1 else ()
    return (q, v, attention, *reduce_scatter, gate, down, *reduce_scatter)


def layer_input_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool = False) -> int:
    """A layer's input (the residual stream), all that full recomputation keeps per layer: sequence-
    sharded by t under SP, by c always; FP32 under ``autocast`` (:func:`torch_autocast`: the residual
    stream is FP32 — traced, ``tiny`` pp 2, full recomputation, BF16: each checkpoint keeps an FP32
    (s, h) input; counted in BF16, stage 0 read 6 % under)."""
    sbh = t.seq_len * t.micro_batch_size * m.hidden_size
    div = p.cp * (p.tp if (p.sequence_parallel and p.tp > 1) else 1)
    return (4 if autocast else elem_bytes(t.precision)) * sbh // div


def inflight_chunks(p: ParallelSpec, t: TrainSpec, *, stage: int) -> int:
    """Model chunks (of L/(pp·v) layers) whose activations ``stage`` holds at its peak.

    - pp = 1: one micro-batch at a time (gradient accumulation runs them in sequence).
    - GPipe: all m micro-batches' forwards run before any backward.
    - 1F1B: stage i holds min(pp − i, m) (Narayanan et al. 2021, arXiv 2104.04473, §2.2; Megatron's
      ``num_warmup_microbatches = pp − i − 1`` plus the one in flight).
    - Interleaved 1F1B with v chunks per rank: Megatron's warm-up ``2·(pp − i − 1) + (v − 1)·pp`` plus
      one, capped at m·v; on stage 0 that is L·(1 + (pp − 1)/(pp·v)) layers' worth, Korthikanti's factor.
    """
    pp, m, v = p.pp, t.num_microbatches, p.virtual_stages
    if pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return m
    if p.pp_schedule == "interleaved_1f1b":
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return min(pp - stage, m)


def stage_layer_activations(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    stage: int,
    engine: str,
    fused_norm: bool = False,
    autocast: bool = False,
) -> int:
    """The activations of all layers ``stage`` holds at its peak, with recomputation applied.

    Full recomputation keeps each checkpoint's input (:func:`checkpointed_layers`: every layer's, or
    with ``recompute_every`` N every N-th, the first N, or one per group of N; blocks no checkpoint
    covers keep everything) and, while one checkpoint is recomputed in backward, its full activations
    once (Korthikanti §4.2: 2sbhL/t plus one layer; the recomputed layer's input, its first norm input,
    is counted once; :func:`recompute_working_set`).
    Selective recomputation keeps everything but the attention kernel's extra tensors, which one
    layer's recomputed attention core holds again during backward; op keeps :func:`op_layer_bytes`
    per layer and one layer's recomputation (:func:`recompute_working_set`).
    """
    chunks = inflight_chunks(p, t, stage=stage)
    chunk = 0
    if t.recompute == "full":
        chunk = checkpointed_layers(m, p, t) * layer_input_bytes(m, p, t, autocast=autocast)
    # Each kind of block (dense first layers, expert blocks) at its own size: under full recomputation
    # the blocks no checkpoint covers keep everything.
    for kind, blocks, covered in covered_blocks(m, p, t):
        kept = blocks - covered if t.recompute == "full" else blocks
        if kept:
            chunk += kept * layer_activation_bytes(
                kind,
                p,
                t,
                engine=engine,
                recompute="none" if t.recompute == "full" else None,
                fused_norm=fused_norm,
                autocast=autocast,
            )
    return chunks * chunk + recompute_working_set(
        m, p, t, engine=engine, fused_norm=fused_norm, autocast=autocast
    )


def recompute_working_set(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    engine: str,
    fused_norm: bool = False,
    autocast: bool = False,
) -> int:
    """What :func:`stage_layer_activations` counts for the one layer recomputed during backward, beyond
    what the stage keeps: full, that layer's activations less its kept input — 0 if no block of a chunk
    is checkpointed, or if the chunk's last block is not (``recompute_every`` not dividing the chunk's
    layers, or ``block`` with N below the chunk's layers): backward has then freed the trailing blocks'
    full activations before it recomputes the last checkpointed one; ``uniform``, the N blocks of a
    group recomputed at once less the group's kept input (N·layer − input), one input fewer where the
    chunk's last group is shorter: the first full group is recomputed after the last group's backward
    has freed that group's input; op, its activations less what the policy kept, plus the block's
    output, which the replay recomputes too (measured on one ``tiny`` block: 13.77 sbh above
    ``none``'s backward against 20.05 − 7.28 = 12.77); selective, its attention core again; none, 0."""
    if t.recompute == "none":
        return 0
    full_layer = layer_activation_bytes(
        m, p, t, engine=engine, recompute="none", fused_norm=fused_norm, autocast=autocast
    )
    # Without a pipeline the recomputed blocks cast their weights again (:func:`checkpointed_casts`).
    casts = 2 * layer_params(m, tp=p.tp, ep=p.ep) if autocast and engine == "torch" and p.pp == 1 else 0
    if t.recompute == "full":
        layers, n = m.num_layers // (p.pp * p.virtual_stages), t.recompute_every
        kept = layer_input_bytes(m, p, t, autocast=autocast)
        if t.recompute_method == "uniform":
            freed = kept if (layers > n and layers % n) else 0
            return min(n, layers) * (full_layer + casts) - kept - freed
        last_checkpointed = n >= layers if t.recompute_method == "block" else layers % n == 0
        return full_layer + casts - kept if last_checkpointed else 0
    if t.recompute == "op":
        return (
            full_layer
            + casts
            - op_layer_bytes(m, p, t, autocast=autocast)
            + layer_input_bytes(m, p, t, autocast=autocast)
        )
    return full_layer - layer_activation_bytes(
        m, p, t, engine=engine, fused_norm=fused_norm, autocast=autocast
    )


def checkpointed_casts(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool) -> int:
    """The BF16 weight casts of checkpointed blocks that are gone by the backward's peak (torch, bytes
    per rank; :func:`states.param_copies` counts every weight's cast as kept); they are alive at the
    forward's end, a candidate peak of its own (``stage.forward_end``). A checkpoint drops what
    its matmuls would save, and torchtitan's op policy saves matmul outputs, never the casts, so only
    autocast's cache holds them — until the autocast region ends. The runner's region is one
    micro-batch's forward without a pipeline (``compose.train_step``: backward runs after it), so the
    cache is cleared before backward, whose recomputation casts one block (a ``uniform`` group: N) at a
    time again (:func:`recompute_working_set`); under a pipeline the region is the whole schedule step,
    the cache keeps every cast through backward and the recomputations reuse them: 0 there.

    Traced on real CPU runs (``tiny``, BF16 autocast): with full recomputation on one rank, the casts
    were freed as the forward's autocast region closed, before the loss's gradient (the peak), where
    2.4 MiB were counted (single-rank full and op points read 2.7-3.8 % over); under pp 2 with 4
    micro-batches the first forward's casts were still alive at stage 0's peak in a recomputed block's
    backward."""
    if not autocast or p.pp > 1 or t.recompute not in ("full", "op"):
        return 0
    covered = covered_blocks(m, p, t)
    return p.virtual_stages * sum(2 * layer_params(kind, tp=p.tp, ep=p.ep) * n for kind, _, n in covered)


def backward_working_set(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """What a block's backward holds at its peak beyond the activations (torch): its MLP's gradients,
    three b·(s/c)·(f/t) tensors in the compute dtype — the gradient of the down projection's input,
    then those of the gate and up projections' outputs made from it — less the down projection's saved
    input (one of the same size), which autograd releases once that projection's backward has run,
    before the other two are made: two above the activations, at the first backward, when every
    in-flight micro-batch's activations are still alive. On the last stage the loss's buffers (the
    logits' gradient) are larger and gone before a block's backward starts, so the working set is a
    peak of its own only on the other stages. Traced on ``tiny`` (s 512, b 4, pp 2, 2 micro-batches),
    stage 0: 3 × 2.75 MiB of FP32 "temporaries" at the peak (also under full recomputation and GPipe;
    3 × 1.375 MiB in BF16 and at tp 2), with the activations one 2.75 MiB tensor short of all in-flight
    ones; at Llama-2-7B's shapes (s 8192, BF16, pp 2-8) seven of eight in-flight b·s·f tensors of
    the last block alive beside the three."""
    if m.moe:
        return moe_backward_working_set(m, p, t)
    tokens = t.micro_batch_size * (t.seq_len // p.cp)
    return 2 * tokens * (m.ffn_hidden_size // p.tp) * elem_bytes(t.precision)


def backward_working_sets(
    m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, loss_chain: int, fused_norm: bool, autocast: bool
) -> tuple[int, int, int]:
    """(recomputed, gradients, counted): the backward's two working sets beside a stage's kept
    activations, torch — the recomputed block's (:func:`recompute_working_set`, which
    :func:`stage_layer_activations` counts whole) and a block's gradients (:func:`backward_working_set`),
    both alive in a block's backward — and ``counted``: what the stage's ``activations`` term holds of
    them beside the loss's buffers (``loss_chain``: logits and loss), which are never alive with them:
    each only where it exceeds those buffers, except that GPipe keeps every micro-batch's loss buffers,
    so its recomputation is counted whole. Measured on the CPU study: full recomputation was
    over-predicted by ~19 % when both were added. The one place that knows this fold
    (``stage._activation_terms``, ``stage.forward_end``, ``peaks.fsdp_block_backward``)."""
    working = recompute_working_set(m, p, t, engine="torch", fused_norm=fused_norm, autocast=autocast)
    gradients = backward_working_set(m, p, t)
    kept = working if p.pp > 1 and p.pp_schedule == "gpipe" else working - min(working, loss_chain)
    return working, gradients, kept + max(0, gradients - loss_chain)


def _last_stage_inflight(p: ParallelSpec, t: TrainSpec) -> int:
    """Micro-batches whose output layer and logits the last stage holds at once."""
    return t.num_microbatches if (p.pp > 1 and p.pp_schedule == "gpipe") else 1


def token_ids(p: ParallelSpec, t: TrainSpec, *, stage: int, engine: str) -> int:
    """int64 token ids (and targets), 8·s·b bytes per micro-batch, sequence-split by c.

    megatron: the in-flight micro-batches' ids on stage 0 (the paper's ``8p`` term). torch: the runner
    materialises the whole step's ids on stage 0 and the targets on the last stage (m micro-batches).
    """
    per_mb = 8 * t.seq_len * t.micro_batch_size // p.cp
    last = p.pp - 1
    if engine == "torch":
        return per_mb * t.num_microbatches * ((stage == 0) + (stage == last))
    if stage != 0:
        return 0
    if p.pp == 1:
        return per_mb
    return per_mb * (t.num_microbatches if p.pp_schedule == "gpipe" else min(p.pp, t.num_microbatches))


def output_activations(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    stage: int,
    engine: str,
    fused_norm: bool = False,
    autocast: bool = False,
) -> int:
    """The last stage's final-norm input and LM-head input (Korthikanti's 4sbh/t at e = 2 with SP);
    torch's norm also keeps its normalised output (:func:`norm_tensors`), in :func:`norm_elem_bytes`.

    torch: the head's column-parallel plan all-gathers its input, which autograd saves, so that half is
    / c only; without SP neither half is sharded by t.
    """
    if stage != p.pp - 1:
        return 0
    sbh = t.seq_len * t.micro_batch_size * m.hidden_size
    sp = p.sequence_parallel and p.tp > 1
    norm_in = norm_tensors(engine, fused_norm=fused_norm) // 2 * sbh // (p.cp * (p.tp if sp else 1))
    head_in = sbh // (p.cp * (p.tp if (sp and engine == "megatron") else 1))
    norm_elem = norm_elem_bytes(t, engine=engine, fused_norm=fused_norm, autocast=autocast)
    return (norm_elem * norm_in + elem_bytes(t.precision) * head_in) * _last_stage_inflight(p, t)


def vocab_shards(p: ParallelSpec, *, engine: str) -> int:
    """How many ways the logits are split: t·c, except in the torch runner under pipelining, whose
    stages exchange plain tensors, so the head's output is gathered over t (no loss_parallel)."""
    return p.cp if (engine == "torch" and p.pp > 1) else p.tp * p.cp


def held_outputs(p: ParallelSpec, t: TrainSpec, *, engine: str) -> int:
    """Logit-sized tensors per in-flight micro-batch at the last stage's peak, counted once more under
    torch's pipelining (measured on the runner: +b·s·v·4 bytes on the last stage at FP32). Without a
    pipeline the output is consumed by the loss and only its gradient remains. Under torch's
    pipelining the schedule's forward cache keeps each stage output until that micro-batch's
    backward, and the loss's backward adds the FP32 gradient of the upcast logits (:func:`logits`
    says which of them are in which dtype)."""
    extra = 1 if (engine == "torch" and p.pp > 1) else 0
    return _last_stage_inflight(p, t) + extra


def logits(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, stage: int, engine: str = "megatron") -> int:
    """The head's output in the compute dtype (or its gradient), vocabulary-sharded, kept until the
    loss's backward: b·s·v/(t·c) × elem × :func:`held_outputs`.

    torch without tp or pp (the fused single-rank loss, ``compose.loss_fn``): the third tensor at the
    loss's backward peak, beside the saved FP32 log-softmax and the FP32 gradient of it
    (:func:`harness.estimate.buffers.loss`), is ``_log_softmax_backward_data``'s FP32 output, the
    gradient of the upcast logits — FP32 whatever the compute dtype (traced with ``run.mode=fake``,
    Llama-3-8B BF16: 3 × 4 B per logit at the peak; issue 14).

    torch under pipelining: the forward cache's head outputs, one per in-flight micro-batch (GPipe:
    all m), in the compute dtype, plus that FP32 gradient of the upcast logits. Traced on ``tiny``
    (s 512, b 4, pp 2, BF16), the last stage's peak holds 3 FP32 logit-sized tensors and 1 BF16 one
    under 1F1B, 4 and 2 under GPipe with 2 micro-batches (with :func:`harness.estimate.buffers.loss`'s
    FP32 softmax and its gradient); the engine had counted that gradient in the compute dtype, 11 %
    short of the BF16 trace (FP32 cannot tell them apart).

    torch under tp without pp (``loss_parallel``, :func:`harness.estimate.buffers.loss`'s three FP32
    shards): the fourth is FP32 too — the upcast of the BF16 logits, which the sharded log-softmax's
    decomposition keeps while the BF16 output is freed (traced: ``tiny``, tp 2, s 512, BF16, four
    FP32 vocabulary shards at the peak and no BF16 one; counted in BF16 the BF16 CPU study's tp points
    read 6-8 % under)."""
    if stage != p.pp - 1:
        return 0
    sbv = t.seq_len * t.micro_batch_size * m.vocab_size
    if engine == "torch" and p.pp > 1:
        per_logit = elem_bytes(t.precision) * _last_stage_inflight(p, t) + 4
        return per_logit * sbv // vocab_shards(p, engine=engine)
    elem = 4 if engine == "torch" else elem_bytes(t.precision)
    return elem * sbv // vocab_shards(p, engine=engine) * held_outputs(p, t, engine=engine)
