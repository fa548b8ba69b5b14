"""Parameter counts of a Llama model: per layer, per pipeline stage, per tensor-parallel rank.

ESTIMATOR.md §1. Per transformer layer: attention 2h²(1 + k/a) (Q and O are h×h, K and V are
h×(h·k/a)); with a head size d of its own (Qwen3's ``head_dim``) 2·h·d·(a + k), and Qwen3's query and
key norms 2d; SwiGLU MLP 3·h·f, two RMSNorm weights 2h. Embedding h·v, final norm h, LM head h·v
unless tied; Qwen2's Q, K and V biases h(1 + 2k/a) where ``qkv_bias``. Tensor parallelism shards every
matrix (and those biases) by t (vocabulary-parallel embedding and head); norm weights are replicated.
Stage 0 holds the embedding, the last stage the final norm and the head.

A mixture-of-experts block (``model.num_experts`` E > 0) has, in place of the SwiGLU MLP, a router h·E,
E experts of 3·h·f_e and shared experts 3·h·f_e·n_s (harness/runner/moe.py; Megatron's
``theoretical_memory_usage.py`` counts the same: routed experts 2·h·f_e·E·3/2 with SwiGLU, router h·E,
shared experts 2·h·f_s·3/2). Mixtral-8x7B: 46,702,792,704. The first ``moe_dense_layers`` blocks of
such a model have the dense SwiGLU MLP of ``ffn_hidden_size`` (DeepSeek-V3's ``first_k_dense_replace``;
Megatron's ``moe_layer_freq`` pattern with zeros first): a stage's count of each kind is
:func:`chunk_blocks` of its view.
"""

from __future__ import annotations

import heapq

from harness.spec import ModelSpec, dense_mlp_model


def mlp_matrices(m: ModelSpec, *, ep: int = 1) -> list[int]:
    """The elements of each matrix of one block's MLP on one rank: the three SwiGLU projections, or a
    mixture of experts' router, the three of each of its E/ep experts (expert parallelism) and the
    shared experts' three."""
    h = m.hidden_size
    if not m.moe:
        return [h * m.ffn_hidden_size] * 3
    shared = m.moe_ffn_hidden_size * m.num_shared_experts
    return (
        [h * m.num_experts]
        + [h * m.moe_ffn_hidden_size] * (3 * (m.num_experts // ep))
        + ([h * shared] * 3 if shared else [])
    )


def mlp_shards(m: ModelSpec, *, tp: int = 1, ep: int = 1) -> list[tuple[int, int]]:
    """(global, local) elements of each matrix of :func:`mlp_matrices` on one tensor-parallel rank:
    sharded by t, but a mixture of experts' router (the first), replicated on every tp rank
    (harness/runner/parallel/tensor.py ``moe_plan``)."""
    return [(n, n if m.moe and i == 0 else n // tp) for i, n in enumerate(mlp_matrices(m, ep=ep))]


def layer_matrix_params(m: ModelSpec, *, ep: int = 1) -> int:
    """Weights of one layer's matrices: Q, K, V, O and the MLP's (:func:`mlp_matrices`)."""
    h = m.hidden_size
    return 2 * h * m.q_width + 2 * h * m.kv_width + sum(mlp_matrices(m, ep=ep))


def qkv_bias_params(m: ModelSpec) -> int:
    """The Q, K and V projections' biases of one layer (Qwen2: h + 2·h·k/a; 0 without ``qkv_bias``),
    sharded with their columns under tensor parallelism."""
    if not m.qkv_bias:
        return 0
    return m.q_width + 2 * m.kv_width


def router_params(m: ModelSpec) -> int:
    """A mixture of experts' router, h·E, replicated on every tensor-parallel rank
    (harness/runner/parallel/tensor.py ``moe_plan``); 0 for a dense model or block."""
    return m.hidden_size * m.num_experts if m.moe else 0


def layer_params(m: ModelSpec, *, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (norm weights and a router
    replicated; Qwen3's query and key norms of d each); with expert parallelism, its share of the
    experts."""
    router = router_params(m)
    sharded = layer_matrix_params(m, ep=ep) - router + qkv_bias_params(m)
    return sharded // tp + router + 2 * m.hidden_size + qk_norm_params(m)


def qk_norm_params(m: ModelSpec) -> int:
    """Qwen3's RMSNorm weights of the query and key heads (``qk_norm``): 2·d, replicated."""
    return 2 * m.head_size if m.qk_norm else 0


def block_kinds(m: ModelSpec, layers: int, dense: int) -> tuple[tuple[ModelSpec, int], ...]:
    """(model as the block reads it, count) of ``layers`` blocks whose first ``dense`` have a dense MLP:
    the one sum every per-block total goes through (dense first layers, ``moe_dense_layers``)."""
    if not dense or not m.moe:
        return ((m, layers),)
    return ((dense_mlp_model(m), dense), (m, layers - dense))


def chunk_blocks(m: ModelSpec, chunks: int) -> tuple[tuple[ModelSpec, int], ...]:
    """:func:`block_kinds` of one of ``chunks`` model chunks (pp, or pp·v under interleaving) of a stage
    view's model (``harness.spec.stage_view``: its ``num_layers`` and ``moe_dense_layers`` are the
    stage's own, times pp; validation refuses dense first layers under interleaving)."""
    return block_kinds(m, m.num_layers // chunks, m.moe_dense_layers // chunks if m.moe else 0)


def total_params(m: ModelSpec) -> int:
    """The model's parameter count, as published (Llama-3-8B: 8,030,261,248)."""
    head = 0 if m.tie_embeddings else m.hidden_size * m.vocab_size
    layers = sum(n * layer_params(k) for k, n in chunk_blocks(m, 1))
    return layers + m.hidden_size * m.vocab_size + m.hidden_size + head


def non_layer_params(m: ModelSpec, *, stage: int, pp: int, tp: int = 1) -> int:
    """Embedding, final norm and LM head held by ``stage`` of ``pp`` on one tensor-parallel rank.

    With tied embeddings and pp > 1 the last stage keeps its own copy of the shared matrix (as
    Megatron-LM does, gradients all-reduced between the two stages); with pp = 1 it is counted once.
    """
    h, v = m.hidden_size, m.vocab_size
    out = 0
    if stage == 0:
        out += h * v // tp
    if stage == pp - 1:
        out += h
        if not (m.tie_embeddings and pp == 1):
            out += h * v // tp
    return out


def stage_params(m: ModelSpec, *, stage: int, pp: int, tp: int = 1, ep: int = 1) -> int:
    """Parameters on one rank of pipeline ``stage`` (its L/pp layers plus its share of the rest; with
    expert parallelism 1/ep of the experts)."""
    layers = sum(n * layer_params(k, tp=tp, ep=ep) for k, n in chunk_blocks(m, pp))
    return layers + non_layer_params(m, stage=stage, pp=pp, tp=tp)


def expert_params(m: ModelSpec, *, stage: int, pp: int, ep: int = 1, tp: int = 1) -> int:
    """The routed experts' parameters one rank of ``stage`` holds (1/ep of them; 0 for a dense model)."""
    return expert_layers(m, pp) * layer_expert_params(m, ep=ep, tp=tp)


def layer_expert_params(m: ModelSpec, *, ep: int = 1, tp: int = 1) -> int:
    """The routed experts' parameters of one expert block on one rank (1/ep of them, each sharded over
    the tp ranks as an MLP is; 0 for a dense model or block)."""
    return 3 * m.hidden_size * m.moe_ffn_hidden_size * (m.num_experts // ep) // tp if m.moe else 0


def expert_layers(m: ModelSpec, pp: int) -> int:
    """Blocks with experts on one stage of a stage view's model (0 for a dense model)."""
    return sum(n for k, n in chunk_blocks(m, pp) if k.moe)


def param_numels(m: ModelSpec, *, stage: int, pp: int, tp: int = 1) -> list[tuple[int, int]]:
    """(global, local) elements of each parameter tensor on one rank of pipeline ``stage``: what
    ``numel()`` says of it (a DTensor's is its global size) and what the rank holds. The embedding
    (stage 0), every block's two norms, Q, K, V and O (and Q/K/V biases), the three SwiGLU matrices,
    the final norm and the head (last stage; one tensor with the embedding when tied with pp = 1).
    Matrices and biases are sharded by t, norms replicated; the sum of the locals is
    :func:`stage_params`."""
    h, v = m.hidden_size, m.vocab_size
    q, kv = m.q_width, m.kv_width
    out = []
    if stage == 0:
        out.append((h * v, h * v // tp))
    for kind, layers in chunk_blocks(m, pp):
        block = [(h, h), (h, h)]  # the two norms
        if m.qk_norm:
            block += [(m.head_size, m.head_size)] * 2
        block += [(n, n // tp) for n in (h * q, h * kv, h * kv, h * q)] + mlp_shards(kind, tp=tp)
        if m.qkv_bias:
            block += [(n, n // tp) for n in (q, kv, kv)]
        out += block * layers
    if stage == pp - 1:
        out.append((h, h))
        if not (m.tie_embeddings and pp == 1):
            out.append((h * v, h * v // tp))
    return out


def zero1_partitions(numels: list[tuple[int, int]], shards: int) -> list[int]:
    """The local elements ``ZeroRedundancyOptimizer`` gives each rank of its group, in group-rank order:
    the parameters sorted by ``numel()``, largest first, each to the rank with the fewest elements so far
    (the lowest such rank on a tie; torch 2.13 ``_partition_parameters``, one parameter group)."""
    # A heap of (elements so far, rank): the smallest total, and the lowest rank among equal ones, first —
    # torch's ``sizes.index(min(sizes))`` in O(log d·c) (``plan`` asks for groups of thousands).
    heap = [(0, rank) for rank in range(shards)]
    local = [0] * shards
    for total, mine in sorted(numels, key=lambda x: x[0], reverse=True):
        size, rank = heapq.heappop(heap)
        local[rank] += mine
        heapq.heappush(heap, (size + total, rank))
    return local
