"""What a pipeline stage holds for its boundaries (torch's ``torch.distributed.pipelining``; megatron's
one buffer per direction): the stage-boundary activation, the outputs kept for backward, the receive
buffers, the sends the schedules keep alive, and the receive buffer a stage's first block saves.

ESTIMATOR.md §3 (activations) and §5 (buffers); each function names the trace that found it.
"""

from __future__ import annotations

from harness.estimate.activations import inflight_chunks
from harness.estimate.dtypes import elem_bytes, norm_elem_bytes
from harness.spec import ModelSpec, ParallelSpec, TrainSpec


def boundary_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool = False) -> int:
    """One stage-boundary activation of one micro-batch, s·b·h/(t·c) with SP, /c without; FP32 under
    autocast, where the stages exchange the residual stream (runner/fake.py ``hidden_meta_dtype``)."""
    sp = p.sequence_parallel and p.tp > 1
    elem = 4 if autocast else elem_bytes(t.precision)
    return elem * t.seq_len * t.micro_batch_size * m.hidden_size // (p.cp * (p.tp if sp else 1))


def pipeline_stage_outputs(
    m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, stage: int, engine: str, autocast: bool = False
) -> int:
    """The stage outputs of the in-flight micro-batches (torch, 1F1B and GPipe): every stage but the
    last keeps each in-flight micro-batch's output for its backward (``torch.distributed.pipelining``'s
    forward cache), a tensor no layer saves (the layers count their inputs), one stage boundary
    (:func:`boundary_bytes`) each.

    Traced (``run.mode=fake``, Llama-2-7B's shapes cut to one layer per stage, s 8192, BF16 under
    autocast, pp 2/4/8): stage 0 keeps three FP32 (s, h) tensors per in-flight micro-batch — the
    embedding's output, the layer's second residual, its output — where the layers count two; the
    engine read 3.3/4.6/5.7 % under there, every paper-grid pp 8 point 1.5-1.9 %. ``tiny`` FP32 shows
    the same, one per micro-batch; on its pp 4 ranks 1 and 2 this brings the engine from 1.1 and 1.5 %
    under to 1.0 and 0.5 % over (``scripts/pipeline_ranks.py``). A later stage's first layer saves its
    receive buffer (a view of it), which :func:`pp_p2p` counts too; the traces show no excess
    that would match that double count, and it is left as it is. Interleaved 1F1B spreads a rank's
    in-flight micro-batches over its virtual stages: not counted."""
    if engine != "torch" or p.pp == 1 or p.pp_schedule == "interleaved_1f1b" or stage == p.pp - 1:
        return 0
    return inflight_chunks(p, t, stage=stage) * boundary_bytes(m, p, t, autocast=autocast)


def received_input_saved(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    stage: int,
    engine: str,
    fused_norm: bool = False,
    autocast: bool = False,
) -> int:
    """What the layers count twice on a stage that receives its input (torch, 1F1B and GPipe, stage >
    0): the first block of every in-flight micro-batch saves the receive buffer itself — a checkpoint
    (full recomputation of the first block, torchtitan's op policy) keeps its input, and the first
    RMSNorm keeps its input when it needs no cast (:func:`dtypes.norm_elem_bytes` equal to the
    boundary's element size: FP32 boundaries under autocast or FP32, CUDA's fused kernel) — and
    :func:`pp_p2p` counts that buffer already. On the CPU without autocast the composite norm
    keeps an FP32 upcast of the BF16 buffer instead: nothing counted twice there.

    Traced on a real CPU run (``tiny``, pp 4, 4 micro-batches, BF16 autocast): stage 1's peak held 13
    FP32 (s, h) tensors besides its receive buffers where the layers counted 16, one per in-flight
    micro-batch; GPipe's middle stages, with every micro-batch in flight, read 3-4 % over. Interleaved
    1F1B (whose rank 0 holds chunks that receive and chunks that do not) is left as it is."""
    if engine != "torch" or stage == 0 or p.pp == 1 or p.pp_schedule == "interleaved_1f1b":
        return 0
    if t.recompute == "full":
        first_checkpointed = t.recompute_method != "every" or t.recompute_every == 1
    else:
        first_checkpointed = t.recompute == "op"
    same_dtype = norm_elem_bytes(t, engine=engine, fused_norm=fused_norm, autocast=autocast) == (
        4 if autocast else elem_bytes(t.precision)
    )
    if not (first_checkpointed or same_dtype):
        return 0
    return inflight_chunks(p, t, stage=stage) * boundary_bytes(m, p, t, autocast=autocast)


def pp_p2p(
    m: ModelSpec,
    p: ParallelSpec,
    t: TrainSpec,
    *,
    stage: int,
    engine: str,
    autocast: bool = False,
    gloo: bool = False,
) -> int:
    """Pipeline receive buffers of one stage-boundary activation (s·b·h/(t·c) with SP, /c without).

    torch: ``torch.distributed.pipelining`` allocates a forward receive buffer per micro-batch (all
    stages but the first) and a gradient receive buffer per micro-batch (all but the last), for every
    virtual stage, once, and keeps them; 1F1B and interleaved 1F1B also keep some of what they have
    sent (:func:`one_f_one_b_sends_kept`, :func:`interleaved_sends_kept`). megatron: one buffer per
    direction, reused. ``gloo``: the ranks talk over gloo (``device=cpu``), whose works hold their
    tensors.
    """
    if p.pp == 1:
        return 0
    one = boundary_bytes(m, p, t, autocast=autocast)
    if engine != "torch":
        return one * ((stage > 0) + (stage < p.pp - 1))
    # Every virtual stage this rank holds (global ids stage, stage + pp, …) receives from each neighbour
    # it has: interleaved ranks hold both kinds (measured: 3 buffers per micro-batch on both ranks of
    # pp 2, v 2).
    last = p.pp * p.virtual_stages - 1
    ids = [stage + k * p.pp for k in range(p.virtual_stages)]
    received = one * t.num_microbatches * sum((g > 0) + (g < last) for g in ids)
    kept = interleaved_sends_kept(p, t, stage=stage) + one_f_one_b_sends_kept(p, t, stage=stage, gloo=gloo)
    return received + kept * one


def one_f_one_b_sends_kept(p: ParallelSpec, t: TrainSpec, *, stage: int, gloo: bool) -> int:
    """Boundary tensors that torch's 1F1B keeps alive at the stage's peak only because it has sent
    them (torch 2.13 ``Schedule1F1B._step_microbatches``), beyond the forward cache's in-flight
    outputs (:func:`pipeline_stage_outputs`):

    - the gradient sent back by the previous backward: ``bwd_sends``, the list of ``P2POp`` objects
      that hold it, is rebound only after the next backward has run, so backward k ≥ 1 starts with
      backward k − 1's input gradient alive — on every stage but the first, whatever the backend, once
      a backward runs with the warm-up's W = min(m, pp − stage) micro-batches still in flight (m > W);
    - over gloo, whose works hold their tensors (runner/fake/modes.py ``_gloo_works_hold_tensors``),
      the warm-up's last fired forward send: ``send_work`` keeps the work of micro-batch W − 2's output
      through the whole steady state, after its backward has dropped it from the cache; it counts at a
      peak with W still in flight when m ≥ 2W − 1. NCCL's works are not counted (the fake GPU group's
      hold nothing; see docs).

    Traced on a real CPU run (``small3``, pp 3, dp 2, 3 micro-batches, BF16, s 768), stage 1's peak at
    its second backward held exactly two BF16 (s, h) tensors the estimate lacked: micro-batch 0's output
    and its input gradient (2.8 % under before). GPipe drops nothing before its peak, the first
    backward, with every micro-batch in flight: 0 there."""
    if p.pp == 1 or p.pp_schedule != "1f1b":
        return 0
    m = t.num_microbatches
    warmup = min(m, p.pp - stage)
    grad = stage > 0 and m > warmup
    output = gloo and warmup >= 2 and m >= 2 * warmup - 1
    return int(grad) + int(output)


def interleaved_sends_kept(p: ParallelSpec, t: TrainSpec, *, stage: int) -> int:
    """Boundary tensors (of s·b·h/(t·c)) that torch's interleaved 1F1B keeps alive only because it has
    sent them, at the rank's peak.

    ``ScheduleInterleaved1F1B`` runs on ``_PipelineScheduleRuntime``, which waits on its send works
    only when the step ends ("send ops should be waited on before step() exits"), and a work holds its
    tensor: every gradient sent back, and every activation sent on whose micro-batch's backward is done,
    stays allocated until then (1F1B and GPipe wait on theirs as they go). The peak is at the rank's
    last forward: the in-flight chunks are still all there (:func:`activations.inflight_chunks`) and
    every backward of the steady state before it has sent, m·v − W − 1 of them with torch's warm-up
    W = min((v − 1)·pp + 2·(pp − 1 − rank), m·v) (``_get_warmup_ops``; micro-batches per round = pp
    when pp divides m). Each backward of chunk g sends a gradient if g > 0 and frees an activation
    send if g is not the last; the backwards are spread evenly over the rank's chunks. Measured on
    ``tiny``, pp 2, v 2, s 512, b 4, FP32 (1 MiB per tensor), last rank: 18.5 MiB above the estimate
    without this at m = 8 (19 here), 6.5 at m = 4 (7)."""
    if p.pp == 1 or p.pp_schedule != "interleaved_1f1b":
        return 0
    pp, v, m = p.pp, p.virtual_stages, t.num_microbatches
    warmup = min((v - 1) * pp + 2 * (pp - 1 - stage), m * v)
    done = max(0, m * v - warmup - 1)
    last = pp * v - 1
    per_chunk = sum((g > 0) + (g < last) for g in (stage + k * pp for k in range(v)))
    return done * per_chunk // v
