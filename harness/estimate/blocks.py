"""The caching allocator's size rules and the tensors one dense or MoE block keeps, as the reserved
level's mechanism terms (harness/estimate/segments.py, harness/estimate/loss_cache.py) count them:
which pool a request goes to, the segment a lone large block takes (``get_allocation_size`` in
c10/cuda/CUDACachingAllocator.cpp), and one layer's saved tensors per micro-batch on one rank."""

from __future__ import annotations

from harness.estimate.dtypes import elem_bytes
from harness.estimate.moe import routed_rows
from harness.spec import ModelSpec, ParallelSpec, TrainSpec

MIB = 1 << 20
KSMALL_SIZE = MIB  # requests up to 1 MiB go to the small pool: never in the large pool's cache
KMIN_LARGE_ALLOC = 10 * MIB
KLARGE_BUFFER = 20 * MIB
KROUND_LARGE = 2 * MIB
KMIN_BLOCK = 512


def request_size(n: int) -> int:
    """``round_size`` for a request above the small pool's: a multiple of 512 B (kMinBlockSize)."""
    return -(-n // KMIN_BLOCK) * KMIN_BLOCK


def segment_size(size: int) -> int:
    """``get_allocation_size`` for a large-pool request of at least 10 MiB."""
    return -(-size // KROUND_LARGE) * KROUND_LARGE


def block_size(n: int) -> int:
    """The segment a large-pool block of ``n`` bytes takes alone (``get_allocation_size``); 0 for a
    small-pool request."""
    if n <= KSMALL_SIZE:
        return 0
    return segment_size(n) if n >= KMIN_LARGE_ALLOC else KLARGE_BUFFER


def layer_tensors(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool = False) -> tuple[int, ...]:
    """The sizes (bytes) of the tensors one layer keeps for backward per micro-batch on one rank under
    the ``torch`` engine on a GPU (activations.py's list): two norm inputs and the Q and attention
    outputs (sequence-sharded by t·c with SP, by c without), the gathered attention and MLP inputs (by c),
    K and V (full sequence under all-gather context parallelism, by t) and the four SwiGLU tensors (by
    t·c). Full recomputation keeps the layer's input only. ``autocast``
    (:func:`~harness.estimate.dtypes.torch_autocast`): the norms keep FP32 tensors."""
    e = elem_bytes(t.precision)
    tc, c = p.tp * p.cp, p.cp
    sbh = t.seq_len * t.micro_batch_size * m.hidden_size
    sbf = t.seq_len * t.micro_batch_size * m.ffn_hidden_size
    seq_sharded = sbh * e // (tc if p.sequence_parallel else c)
    if t.recompute == "full":
        return (seq_sharded,)
    norm_e = 4 if autocast else e  # under autocast the residual stream is FP32
    norms = sbh * norm_e // (tc if p.sequence_parallel else c)
    sb = t.seq_len * t.micro_batch_size
    kv = sb * m.kv_width * e // p.tp
    q = sb * m.q_width * e // tc
    attention = (norms, norms, sbh * e // c, sbh * e // c, q, q, kv, kv)
    if not m.moe:
        return attention + (sbf * e // tc,) * 4
    # a mixture of experts (harness/estimate/moe.py): the routed rows, each expert's four SwiGLU
    # tensors on its share of them, the combine's FP32 product (sizes of a balanced routing)
    rows = routed_rows(m, p, t)[1]
    per_expert = rows // m.num_experts * (m.moe_ffn_hidden_size // p.tp) * e  # (tp: sharded as an MLP)
    return (
        attention + (rows * m.hidden_size * e, rows * m.hidden_size * 4) + (per_expert,) * (4 * m.num_experts)
    )
