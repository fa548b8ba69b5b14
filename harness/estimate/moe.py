"""Mixture-of-experts terms (issue 27): what one MoE block's MLP keeps for backward, and its FLOPs.

The runner's MoE layer (harness/runner/moe.py) follows torchtitan's (docs/mixture-of-experts.md §1.7,
whose table of saved tensors these terms count). Per micro-batch on one rank, T = b·s/c tokens enter
the layer, N = T·k rows leave the dispatch (k = ``experts_per_token``; dropless, so N whatever the
imbalance), e is the compute dtype's element size:

  router input, FP32 (the gate runs in FP32)       4·T·h
  router scores (softmax or sigmoid), FP32         4·T·E
  each token's experts, int64 (the gather's index) 8·T·k
  top-k normalisation (gates and their sum), FP32  4·T·k + 4·T      (``moe_norm_topk``)
  sort order and each row's token, int64           2 · 8·N
  routed rows in the compute dtype                 e·N·h
  experts' SwiGLU (gate, up, silu, product)        4·e·N·f_e
  combine: the experts' output in FP32, the gates  4·N·h + 4·N
  shared experts: their input and SwiGLU           input + 4·e·T·f_s

The router's input is the MLP's input itself where that is FP32 (FP32 runs and BF16 autocast, whose
residual stream and norms are FP32), else (FSDP2's BF16 parameters) an FP32 copy of it. The shared
experts keep their input as a dense MLP does: under autocast one BF16 cast for each of the gate and up
projections, in FP32 the MLP's input (already kept for the router), under FSDP2's BF16 the BF16 input.
Balanced or not, only N matters on one rank without expert parallelism: the imbalance moves rows
between experts. With it (``parallel.ep``) a rank's experts run the rows the all-to-all brings
(:func:`received_rows`), more on the rank holding the most-loaded expert; the routed buffer it sent is
not kept, the received one is.
"""

from __future__ import annotations

from functools import lru_cache

from harness.estimate.dtypes import elem_bytes
from harness.spec import ModelSpec, ParallelSpec, TrainSpec
from harness.spec.routing import rank_expert_rows


def routed_rows(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> tuple[int, int]:
    """(T, N): the tokens one micro-batch brings to an MoE layer on one rank, b·s/c, and the routed rows
    they make, T·k."""
    tokens = t.micro_batch_size * (t.seq_len // p.cp)
    return tokens, tokens * m.experts_per_token


def received_rows(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> list[int]:
    """Rows each expert a rank runs receives from one micro-batch: without expert parallelism every
    expert's rows of this rank's tokens (context-parallel rank 0); with it (``parallel.ep``), its E/ep
    experts' rows from every rank of its ep group (the first group: dp·cp ranks 0 … ep − 1, whose
    context-parallel ranks are their index mod cp), on the most-loaded rank — the one holding expert 0
    when ``moe_imbalance`` > 1 (harness/runner/moe.py's all-to-all)."""
    return list(
        _received_rows(m, p.ep, p.cp, p.cp_load_balance, t.moe_imbalance, t.seq_len, t.micro_batch_size)
    )


@lru_cache(maxsize=4096)  # (plan asks it several times of every candidate; few differ in these)
def _received_rows(
    m: ModelSpec, ep: int, cp: int, load_balance: bool, imbalance: float, seq_len: int, batch: int
) -> tuple[int, ...]:
    per = m.num_experts // ep
    sources = [
        rank_expert_rows(
            m.num_experts,
            m.experts_per_token,
            imbalance,
            seq_len=seq_len,
            batch=batch,
            cp=cp,
            load_balance=load_balance,
            cp_rank=j % cp,
        )
        for j in range(ep)
    ]
    ranks = [[sum(src[r * per + e] for src in sources) for e in range(per)] for r in range(ep)]
    return tuple(max(ranks, key=sum))


def moe_layer_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool) -> int:
    """Bytes one MoE block's MLP keeps for backward for one micro-batch on one rank (torch engine)."""
    h, big_e, k = m.hidden_size, m.num_experts, m.experts_per_token
    tokens, rows = routed_rows(m, p, t)
    e = elem_bytes(t.precision)
    fp32_input = t.precision == "fp32" or autocast
    router = 4 * tokens * h + 4 * tokens * big_e + 8 * tokens * k
    if m.moe_norm_topk:
        router += 4 * tokens * k + 4 * tokens
    # The experts keep their input rows: this rank's own routed rows, or with expert parallelism the
    # rows the all-to-all brought (the routed buffer it sent is kept by nothing).
    recv = sum(received_rows(m, p, t))
    dispatch = 16 * rows + e * recv * h
    # Under tensor parallelism every tp rank runs the layer on all its tokens, each expert sharded as an
    # MLP is (harness/runner/parallel/tensor.py moe_plan): the SwiGLU tensors by t, the rest whole.
    experts = 4 * e * recv * (m.moe_ffn_hidden_size // p.tp)
    combine = 4 * rows * h + 4 * rows
    shared = 0
    f_shared = m.moe_ffn_hidden_size * m.num_shared_experts // p.tp
    if f_shared:
        if autocast:
            shared_input = 2 * e * tokens * h
        elif fp32_input:
            shared_input = 0
        else:
            shared_input = e * tokens * h
        shared = shared_input + 4 * e * tokens * f_shared
    return router + dispatch + experts + combine + shared


def megatron_moe_layer_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """Bytes one MoE block's MLP keeps for backward for one micro-batch on one rank (megatron engine):
    Megatron-LM's MoE layer with the alltoall token dispatcher, unfused permutation, TransformerEngine's
    grouped GEMM and its fused weighted SwiGLU (the defaults of a Mixtral/Qwen3-MoE recipe), read tensor
    by tensor at Megatron-LM d98e8a6 and TransformerEngine d0067d0 (docs/mixture-of-experts.md §2.1).
    With T tokens, N = T·k routed rows, R the rows this rank's experts receive (:func:`received_rows`),
    e the compute dtype's size and b the router's (its logits' dtype: e, ``moe_router_dtype`` unset):

      the layer's input (the router's GEMM saves it; the shared experts' fc1 the same)  e·T·h
      top-k indices, int64, and the top-k softmax, FP32            8·T·k + 4·T·k
      the argsort of the (E, T) routing map, int64 (a [:N] slice view keeps all of it)   8·T·E
      the permutation's sorted indices, int64                      8·N
      fc1's input (split views), fc1's output (2f), fc2's input (f), the permuted probs  R·(e·(h + 3f) + b)
      the load-balancing loss's softmax over all experts, FP32     4·T·E          (``moe_aux_loss_coeff``)
      shared experts: fc1's output and fc2's input                 3·e·T·f_s
      the dispatcher's state, until the layer's next forward: the probs and the routing map  T·E·(b + 1)

    The last is one copy per layer, counted here with the rest per micro-batch (an over-count of the
    in-flight micro-batches less one under a pipeline). Not the torch engine's layer (torchtitan's,
    :func:`moe_layer_bytes`): Megatron keeps no FP32 copy of the input for the router or of the experts'
    output for the combine, and multiplies the gates inside the experts' activation. Megatron's own
    ``theoretical_memory_usage.py`` counts a MoE block with the dense formula (ffn_hidden_size, no
    top-k), so it is no source for these."""
    h, big_e, k = m.hidden_size, m.num_experts, m.experts_per_token
    tokens, _ = routed_rows(m, p, t)
    e = elem_bytes(t.precision)
    recv = sum(received_rows(m, p, t))
    # Under tensor parallelism (Megatron requires sequence parallelism with it) a rank routes its s/t
    # sequence shard, and the dispatcher all-gathers the received rows over the expert-TP group (ETP =
    # TP, Megatron's default): fc1's input is every tp rank's rows, the SwiGLU tensors are sharded by t.
    mine = tokens // p.tp
    kept = e * mine * h + 12 * mine * k + 8 * mine * big_e + 8 * mine * k
    kept += recv * (e * (h + 3 * m.moe_ffn_hidden_size // p.tp) + e)
    if m.moe_aux_loss_coeff:
        kept += 4 * mine * big_e
    kept += 3 * e * tokens * m.moe_ffn_hidden_size * m.num_shared_experts // p.tp
    return kept + mine * big_e * (e + 1)


def moe_mlp_flops_per_token(m: ModelSpec) -> int:
    """Forward and backward FLOPs of one MoE block's MLP per token (6 per multiply-add weight): the
    router h·E and the active experts' 3·h·f_e·k plus the shared experts' 3·h·f_s — from the active
    parameters, as Megatron's and torchtitan's MFU count them."""
    h = m.hidden_size
    active = h * m.num_experts + 3 * h * m.moe_ffn_hidden_size * (m.experts_per_token + m.num_shared_experts)
    return 6 * active


def moe_backward_working_set(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """What an MoE block's backward holds at its peak beyond the activations, in place of the dense
    MLP's gradients (:func:`harness.estimate.activations.backward_working_set`): the combine's backward
    makes three FP32 (N, h) tensors at once — the rows' gradient gathered from the output's, and the
    multiplication's two products with it (the experts' output's gradient, and the product summed into
    the gates' gradient) — while every saved tensor of the block is still alive. The experts' own
    backward works on their (n_e, f_e) slices, less. Measured: pipeline stage 0 of ``tiny_moe``
    (s 512, BF16 and FP32) read 2.7-4.4 % above the engine with the dense figure, within 0.2 % with
    this one."""
    return 3 * 4 * routed_rows(m, p, t)[1] * m.hidden_size


def moe_op_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """What torchtitan's op policy (harness/runner/parallel/recompute.py) keeps of an MoE block's MLP:
    the outputs of every second matmul, counted through the block — after attention's four (wq and wv
    kept) the router's (the 5th, kept: FP32 (T, E)), then each expert's w1, w3 and w2 in turn (the
    6th, 7th, 8th, ...: expert j keeps w3's output when j is even, w1's and w2's when it is odd), then
    the shared experts'. Each expert's rows from the routing (:func:`received_rows`; with expert
    parallelism also the all-to-all's two outputs). torchtitan's
    grouped GEMM is three matmuls for all experts at once, where its policy would keep the first and
    the third; the runner runs one expert at a time (harness/runner/moe.py), and this counts what it
    keeps."""
    h, f, e = m.hidden_size, m.moe_ffn_hidden_size, elem_bytes(t.precision)
    tokens, routed = routed_rows(m, p, t)
    rows = received_rows(m, p, t)
    kept = 4 * tokens * m.num_experts  # the router's output, the 5th matmul
    if p.ep > 1:
        # torchtitan's list keeps the all-to-all's outputs (``_c10d_functional.all_to_all_single``,
        # which the policy sees beneath the autograd variant the layer calls): the rows received and
        # the rows sent back. Traced (real CPU runs of ``tiny_moe``, ep 2, op): two such tensors per
        # layer at the peak, with DDP and with FSDP2; dp 4 × ep 2 ZeRO-3 read 6.1 % under without them.
        kept += e * sum(rows) * h + e * routed * h
    index = 6
    # under tensor parallelism w1's and w3's outputs by t; w2's is the row-parallel matmul's partial
    # sum, full width (op_layer_bytes' rule for a dense MLP)
    widths = [(n, (f // p.tp, f // p.tp, h)) for n in rows]
    if m.num_shared_experts:
        fs = f * m.num_shared_experts // p.tp
        widths.append((tokens, (fs, fs, h)))
    for n, outs in widths:
        for width in outs:  # w1, w3, w2
            if index % 2:
                kept += e * n * width
            index += 1
    return kept
