"""The frozen specs of one training configuration (model, parallel, train, device) and their allowed values.

Everything below the CLI (estimator, runner, store) takes these dataclasses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
# none; selective: the attention core (Korthikanti et al. 2022); op: torchtitan's op-level policy (the
# outputs of matmuls, every second one excepted, and of the attention kernels are kept, the rest
# recomputed); full: whole transformer blocks (every ``recompute_every``-th one, or Megatron's methods).
RECOMPUTE = ("none", "selective", "op", "full")
# Which blocks full recomputation checkpoints, N = ``recompute_every`` (per pipeline stage / virtual
# chunk): every: every N-th block (torchtitan's layer option); uniform: groups of N consecutive blocks,
# each checkpointed as one unit; block: the first N blocks one by one, the rest not recomputed (Megatron's
# ``--recompute-method uniform|block --recompute-num-layers N``).
RECOMPUTE_METHODS = ("every", "uniform", "block")
PRECISIONS = ("bf16", "fp32")
ATTENTION = ("flash", "math")
# When data parallelism reduces gradients under accumulation (m > 1): after the "last" micro-batch only
# (DDP's no_sync, FSDP2's set_requires_gradient_sync(False) before it: this runner's first choice, and
# Megatron's with overlap off), or after "every_microbatch" (torchtitan's default: FSDP2 reduce-scatters
# each micro-batch's gradients and accumulates the shard; DDP all-reduces each into its buckets).
GRAD_SYNC = ("last", "every_microbatch")
# ZeRO-3's FSDP2 ``reshard_after_forward`` (torchtitan's ``parallelism.fsdp_reshard_after_forward``, same
# values): "always" frees each block's gathered parameters after its forward (this runner's ZeRO-3);
# "never" keeps them to backward, which is ZeRO-2 (the canonical form says so); "default" is torchtitan's:
# always without pipelining, never with it (a stage would all-gather again for every micro-batch).
FSDP_RESHARD = ("default", "always", "never")
# A mixture-of-experts layer's router scores (``model.moe_router``): softmax over all experts (Mixtral,
# Qwen3-MoE, Megatron's default) or a sigmoid per expert (DeepSeek-V3, torchtitan's default).
MOE_ROUTERS = ("softmax", "sigmoid")
# Fields added after the first study, left out of the hashed payload (config_id, raw_id) while they hold
# this default, so that every spec that existed before keeps its id.
ADDED_FIELD_DEFAULTS = {
    "model": {
        "qkv_bias": False,
        "num_experts": 0,
        "experts_per_token": 2,
        "moe_ffn_hidden_size": 0,
        "num_shared_experts": 0,
        "moe_router": "softmax",
        "moe_norm_topk": True,
        "moe_aux_loss_coeff": 0.0,
        "moe_dense_layers": 0,
        "head_dim": None,
        "qk_norm": False,
    },
    "train": {
        "recompute_every": 1,
        "recompute_method": "every",
        "grad_sync": "last",
        "moe_imbalance": 1.0,
        "loss_chunks": 1,
    },
    "parallel": {"fsdp_reshard_after_forward": "always", "pp_layers": (), "ep": 1},
    # The device's memory-beside-tensors constants and step-time figures: config_id hashes only the
    # device's name and capacity; raw_id (invalid points) leaves them out while they hold the default.
    "device": {
        "cuda_context_mib": 0.0,
        "nccl_mib_per_communicator": 0.0,
        "cublas_workspace_mib": 0.0,
        "nccl_channels": 0,
        "nccl_buffsize_mib": None,
        "memory_gbps": None,
        "link_latency_us": None,
        "inter_node_latency_us": None,
    },
}
# Bumped whenever the canonical form or the hashed fields change: old results then get new ids
# instead of silently matching runs of a different meaning.
CONFIG_ID_VERSION = 1


class InvalidSpec(ValueError):
    """A configuration that cannot run; the message lists every reason with its arithmetic."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP; biases only on the Q, K
    and V projections where ``qkv_bias`` (Qwen2 and Qwen2.5). With ``num_experts`` > 0 every block's MLP
    is a mixture of experts (harness/runner/moe.py): a router over ``num_experts`` SwiGLU experts of
    ``moe_ffn_hidden_size``, ``experts_per_token`` of them per token, the top-k gate values normalised
    to sum 1 where ``moe_norm_topk``, plus ``num_shared_experts`` (one SwiGLU of their summed width on
    every token), and a load-balancing loss of ``moe_aux_loss_coeff`` where it is > 0;
    ``ffn_hidden_size`` is then the width of the ``moe_dense_layers`` first blocks' dense MLP
    (DeepSeek's ``first_k_dense_replace``, torchtitan's ``n_dense_layers``), unused where that is 0.
    The canonical form resets the MoE fields of a dense model."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    moe_router: str = "softmax"
    moe_norm_topk: bool = True
    # The load-balancing (auxiliary) loss's coefficient (Megatron's --moe-aux-loss-coeff, Hugging Face's
    # router_aux_loss_coef); 0: none (torchtitan's default balances with a bias outside the step).
    moe_aux_loss_coeff: float = 0.0
    # The first blocks whose MLP stays a dense SwiGLU of ffn_hidden_size (0: every block has experts).
    moe_dense_layers: int = 0
    # Qwen3's attention: a head size of its own (None: hidden_size / num_heads; canonical: None where it
    # is that) and RMSNorm of each query and key head before the rotary embedding (``qk_norm``).
    head_dim: int | None = None
    qk_norm: bool = False

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def block_has_experts(self, index: int) -> bool:
        """Whether block ``index`` (0-based, in model order) has the mixture of experts as its MLP."""
        return self.moe and index >= self.moe_dense_layers

    @property
    def head_size(self) -> int:
        """One attention head's width d: ``head_dim``, or hidden_size / num_heads."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        """The queries' (and the attention output's) width a·d; hidden_size unless ``head_dim``."""
        return self.num_heads * self.head_size

    @property
    def kv_width(self) -> int:
        """The keys' (and values') width k·d."""
        return self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class ParallelSpec:
    """Degrees of the four axes and how each is realised; world = dp·tp·pp·cp.

    ``world_size`` is optional: when given it must equal the product of the degrees, and when ``dp`` is
    ``None`` it is derived from it (``dp = world_size / (tp·pp·cp)``) by :func:`canonical`.
    """

    dp: int | None = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    cp_load_balance: bool = True
    world_size: int | None = None
    # Transformer blocks on each pipeline stage, first to last (torchtitan's layers per stage, Megatron's
    # first/last-stage layer counts); () is num_layers / pp on every stage. Under interleaved 1F1B each
    # stage's count is split evenly over its virtual_stages chunks. Canonical: () where the counts are
    # the even split.
    pp_layers: tuple[int, ...] = ()
    # FSDP_RESHARD, at ZeRO-3 only; canonical: "always", or ZeRO-2 where it resolves to never.
    fsdp_reshard_after_forward: str = "always"
    # Expert parallelism (a mixture of experts): each group of ep consecutive ranks of the flattened
    # dp·cp group holds 1/ep of every MoE block's experts and exchanges routed tokens all-to-all
    # (torchtitan's and Megatron's ep, carved from the data- and context-parallel ranks: not a factor
    # of the world size).
    ep: int = 1

    @property
    def world(self) -> int:
        """Number of ranks (requires a resolved ``dp``)."""
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class TrainSpec:
    """The shape of one optimizer step: micro-batch of ``micro_batch_size`` sequences of ``seq_len``
    tokens, ``num_microbatches`` of them per data-parallel rank (gradient accumulation or pipeline).
    ``num_microbatches`` None means one per pipeline stage, the fewest that fill a 1F1B pipeline
    (resolved by :func:`canonical`)."""

    seq_len: int = 256
    micro_batch_size: int = 1
    num_microbatches: int | None = None
    recompute: str = "none"
    # With recompute=full, only every N-th transformer block is checkpointed (torchtitan's layer option
    # ``selective_ac_option=N``); 1 = every block. Reset to 1 by :func:`canonical` under other modes.
    recompute_every: int = 1
    # With recompute=full, which blocks N (``recompute_every``) selects: "every" N-th (torchtitan), or
    # Megatron's "uniform" (groups of N blocks per checkpoint) or "block" (the first N blocks), N being
    # Megatron's ``--recompute-num-layers``. Reset to "every" by :func:`canonical` under other modes.
    recompute_method: str = "every"
    precision: str = "bf16"
    attention: str = "flash"
    steps: int = 3
    grad_sync: str = "last"  # GRAD_SYNC; canonical: "last" where nothing is accumulated over data parallel
    # Mixture of experts: the most-loaded expert's routed tokens over the balanced share T·k/E (1.0:
    # balanced), the worst case the runner's deterministic routing reproduces and the estimator assumes.
    # Canonical: 1.0 for a dense model.
    moe_imbalance: float = 1.0
    # The head and the loss over this many slices of the rank's tokens, each slice's backward run at
    # once (torchtitan's ChunkedLossWrapper, 8 in its Llama configs): logits exist for 1/N of the tokens.
    loss_chunks: int = 1


@dataclass(frozen=True)
class DeviceSpec:
    """A device preset: capacity in GiB (2^30 bytes), dense BF16 peak in TFLOP/s (None = unknown), links,
    and the memory a process uses beside its tensors (none of these but ``name`` and ``memory_gib`` enter
    the ``config_id``)."""

    name: str
    memory_gib: float
    peak_tflops: float | None = None
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    # Memory beside the tensors (harness/estimate/levels.py), cited in each preset: the CUDA context and
    # NCCL's buffers live outside the caching allocator, cuBLAS's workspaces inside it. 0 on the CPU.
    cuda_context_mib: float = 0.0
    nccl_mib_per_communicator: float = 0.0
    cublas_workspace_mib: float = 0.0
    # What nccl_mib_per_communicator is made of, so that another NCCL_BUFFSIZE can be estimated: ring
    # channels per communicator, and the buffer size in MiB (None: NCCL's default, 4 MiB).
    nccl_channels: int = 0
    nccl_buffsize_mib: float | None = None
    # For the step-time model only (harness/estimate/steptime.py), like the links: not in config_id.
    memory_gbps: float | None = None
    link_latency_us: float | None = None
    inter_node_latency_us: float | None = None  # a group spanning nodes (None: link_latency_us)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


@dataclass(frozen=True)
class RunSpec:
    """One point of a study: what runs (model, parallel, train) and where (device)."""

    model: ModelSpec
    parallel: ParallelSpec
    train: TrainSpec
    device: DeviceSpec

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks (of a canonical spec)."""
        return self.parallel.dp * self.train.micro_batch_size * self.train.num_microbatches


def stage_layers(spec: RunSpec) -> tuple[int, ...]:
    """Transformer blocks on each pipeline stage, first to last: ``parallel.pp_layers``, or the even
    split num_layers / pp."""
    p = spec.parallel
    return tuple(p.pp_layers) or (spec.model.num_layers // p.pp,) * p.pp


def chunk_layer_ranges(spec: RunSpec) -> list[range]:
    """The blocks of each model chunk (pipeline stage id 0 .. pp·v − 1, the "loop" placement: stage id
    k runs on pipeline rank k mod pp), contiguous and in model order; a rank's count is split evenly
    over its chunks."""
    p, per_stage = spec.parallel, stage_layers(spec)
    out, start = [], 0
    for k in range(p.pp * p.virtual_stages):
        size = per_stage[k % p.pp] // p.virtual_stages
        out.append(range(start, start + size))
        start += size
    return out


def stage_kinds(m: ModelSpec, p: ParallelSpec) -> tuple[tuple[int, int], ...]:
    """(blocks, dense blocks) of each pipeline stage, first to last: ``parallel.pp_layers`` or the even
    split, and how many of a stage's blocks are among the model's ``moe_dense_layers`` first ones (0
    for a dense model). The one count :func:`stage_view`, :func:`stage_views` and ``plan``'s dominant
    stages read."""
    per_stage = tuple(p.pp_layers) or (m.num_layers // p.pp,) * p.pp
    first = m.moe_dense_layers if m.moe else 0
    out, start = [], 0
    for blocks in per_stage:
        out.append((blocks, min(max(first - start, 0), blocks)))
        start += blocks
    return tuple(out)


def stage_view(spec: RunSpec, stage: int) -> RunSpec:
    """``spec`` as one stage's estimate reads it: a model whose even split gives every stage that stage's
    blocks (each term of a stage depends on the model only through its own blocks, and on which end of
    the pipeline it is through ``stage``); ``spec`` itself where every stage's blocks are alike (even
    stages, no dense first layers). With dense first layers (``model.moe_dense_layers``) the view's
    count of them is the stage's own times pp, as its ``num_layers`` is
    (``harness.estimate.params.chunk_blocks`` reads it back); a stage of dense blocks only is a dense
    model's (:func:`dense_mlp_model`)."""
    m, p = spec.model, spec.parallel
    if not p.pp_layers and not (m.moe and m.moe_dense_layers):
        return spec
    return _view(spec, stage_kinds(m, p)[stage])


def _view(spec: RunSpec, kind: tuple[int, int]) -> RunSpec:
    """:func:`stage_view` of a stage of ``kind`` (blocks, dense blocks)."""
    m, p = spec.model, spec.parallel
    blocks, dense = kind
    model = dataclasses.replace(m, num_layers=blocks * p.pp)
    if m.moe and m.moe_dense_layers:
        model = (
            dense_mlp_model(model)
            if dense == blocks
            else dataclasses.replace(model, moe_dense_layers=dense * p.pp)
        )
    return dataclasses.replace(spec, model=model, parallel=dataclasses.replace(p, pp_layers=()))


def stage_views(spec: RunSpec) -> tuple[RunSpec, ...]:
    """:func:`stage_view` of every stage, one object per distinct kind of stage (``plan`` estimates tens
    of thousands of layouts; a view is two ``dataclasses.replace``)."""
    m, p = spec.model, spec.parallel
    if not p.pp_layers and not (m.moe and m.moe_dense_layers):
        return (spec,) * p.pp
    by_kind: dict[tuple[int, int], RunSpec] = {}
    return tuple(by_kind.get(k) or by_kind.setdefault(k, _view(spec, k)) for k in stage_kinds(m, p))


def dense_mlp_model(m: ModelSpec) -> ModelSpec:
    """``m`` as its dense first blocks (``moe_dense_layers``) are: the same attention, a SwiGLU MLP of
    ``ffn_hidden_size`` and no experts — what every per-block term reads for such a block."""
    return dataclasses.replace(m, num_experts=0, moe_dense_layers=0)


def busiest_stage_view(spec: RunSpec) -> RunSpec:
    """:func:`stage_view` of the stage with the most blocks (the last on ties, which also runs the
    head): the stage the step-time proxy times, since the slowest stage sets a pipeline's pace."""
    layers = stage_layers(spec)
    return stage_view(spec, max(range(len(layers)), key=lambda i: (layers[i], i)))


def balanced_pp_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> tuple[int, ...] | None:
    """The uneven split ``plan`` gives a pipeline whose stages cannot hold num_layers / pp blocks each:
    ceil(L / pp) blocks a stage, one fewer (one chunk fewer under interleaving) on the first and the
    last stage, then the second and the second to last, … until the counts add up to L — the ends hold
    the embedding and the head (Llama 3, Dubey et al. 2024 §3.3.2: "reducing one Transformer layer each
    from the first and the last stages"; Megatron's --decoder-first/last-pipeline-num-layers).
    () where the even split works, None where no split gives every chunk at least one block."""
    if num_layers % (pp * virtual_stages) == 0:
        return ()
    if num_layers % virtual_stages:
        return None
    units = num_layers // virtual_stages  # blocks in units of one per chunk
    per = -(-units // pp)
    counts = [per] * pp
    # first, last, second, second to last, …
    ends = dict.fromkeys(i for pair in zip(range(pp), range(pp - 1, -1, -1), strict=True) for i in pair)
    for i in list(ends)[: per * pp - units]:
        counts[i] -= 1
    if min(counts) < 1:
        return None
    return tuple(c * virtual_stages for c in counts)
