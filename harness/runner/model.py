"""A Llama-architecture decoder (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU), no parallel code.

Module names follow torchtitan's (``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``,
``norm``, ``output``) so that the tensor-parallel plan reads like theirs. Layers live in a ModuleDict
keyed by their global index, so a pipeline stage is the model with other layers deleted. Attention's
core (``Attention.core``) and its rotary tables (``Attention.rope_cos/sin``, one row per local token
position) are attributes that context parallelism swaps; nothing here knows about it. ``attention``
picks SDPA's kernel (``train.attention``): ``flash`` (no score matrix kept) or ``math`` (scores kept).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from harness.spec import ModelSpec

# train.attention → the SDPA backends allowed. Without a choice SDPA picks a fused kernel on its own, and
# ``math`` runs never ran the math kernel (issue 15). ``flash`` allows the fused kernels, none of which
# keeps a score matrix: flash first (the only one on CPU), then memory-efficient (CUDA FP32, and the
# boolean mask of context parallelism) and cuDNN.
KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}


def rope_tables(
    seq_len: int, head_dim: int, *, theta: float = 500_000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-valued RoPE tables (cos, sin) of shape (seq_len, head_dim), Llama 3's base."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: str, **kw: object) -> torch.Tensor:
    """SDPA over (batch, heads, seq, head_dim) on ``kernel`` only (an error, not a silent fallback, if
    that kernel cannot run the call); GQA without copies where the kernel allows it."""
    with sdpa_kernel(KERNELS[kernel], set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


class CausalAttention:
    """The default attention core: causal SDPA on one kernel."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, kernel=self.kernel, is_causal=True)


def init_std(m: ModelSpec, name: str) -> float:
    """The initial standard deviation of a matrix: 0.02, output projections scaled by depth."""
    if name.endswith(("wo.weight", "w2.weight")):  # (an expert's w2 too: experts.<e>.w2.weight)
        return 0.02 / math.sqrt(2 * m.num_layers)
    return 0.02


def init_key(name: str, *, tied: bool) -> str:
    """A parameter's name as the whole model knows it, whatever wrappers a rank's copy went through
    (activation checkpointing's, DDP's ``module.``), and the head's as the embedding's when tied: the
    key of its initial value."""
    parts = [p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")]
    if parts and parts[0] == "module":
        parts = parts[1:]
    key = ".".join(parts)
    return "tok_embeddings.weight" if tied and key == "output.weight" else key


def initial_value(
    m: ModelSpec, key: str, shape: tuple[int, ...], *, seed: int, device: torch.device
) -> torch.Tensor:
    """The whole initial value of parameter ``key`` (FP32, ``shape``): ones for norm weights, else
    normal with :func:`init_std` (biases too: a zero bias would not show a wrongly sharded one), from a
    generator seeded by ``seed`` and the key alone — the same on every rank and in every layout, so
    each rank can take its shard of it (a model built on the meta device) and the single-rank reference
    starts from the same weights."""
    if len(shape) == 1 and not key.endswith(".bias"):
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    return torch.empty(shape, device=device).normal_(0.0, init_std(m, key), generator=gen)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, m: ModelSpec, seq_len: int, attention: str = "flash"):
        super().__init__()
        self.kernel = attention
        self.head_dim = m.head_size
        self.wq = nn.Linear(m.hidden_size, m.q_width, bias=m.qkv_bias)
        self.wk = nn.Linear(m.hidden_size, m.kv_width, bias=m.qkv_bias)
        self.wv = nn.Linear(m.hidden_size, m.kv_width, bias=m.qkv_bias)
        self.wo = nn.Linear(m.q_width, m.hidden_size, bias=False)
        # Qwen3: RMSNorm over each query and key head before the rotary embedding
        self.q_norm = RMSNorm(self.head_dim, eps=1e-6) if m.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=1e-6) if m.qk_norm else None
        self.seq_len = seq_len
        # The global token positions this module's rotary rows are for (None: 0 … seq_len − 1); context
        # parallelism sets its rank's slice (parallel/context.py).
        self.positions: torch.Tensor | None = None
        cos, sin = rope_tables(seq_len, self.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.core = CausalAttention(attention)

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the rotary rows for ``positions`` on the buffers' device (after ``to_empty``, or
        when context parallelism changes the positions)."""
        cos, sin = rope_tables(self.seq_len, self.head_dim)
        if self.positions is not None:
            cos, sin = cos.index_select(0, self.positions), sin.index_select(0, self.positions)
        device = self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank sees only its heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:  # on (b, s, heads, d), before the transpose, as Qwen3's own code does
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos[:s].to(q.dtype), self.rope_sin[:s].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU of ``ffn_hidden_size`` (default the model's): a dense block's MLP, or one expert."""

    def __init__(self, m: ModelSpec, *, ffn_hidden_size: int | None = None):
        super().__init__()
        f = ffn_hidden_size or m.ffn_hidden_size
        self.w1 = nn.Linear(m.hidden_size, f, bias=False)
        self.w2 = nn.Linear(f, m.hidden_size, bias=False)
        self.w3 = nn.Linear(m.hidden_size, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Attention and MLP, each after its norm and with a residual; the MLP is ``moe`` (a mixture of
    experts, torchtitan's name) where ``experts`` (by default: where the model has experts), else
    ``feed_forward`` (a dense model's, or one of a mixture of experts' ``moe_dense_layers`` first
    blocks, DeepSeek's and torchtitan's)."""

    def __init__(
        self,
        m: ModelSpec,
        seq_len: int,
        attention: str = "flash",
        *,
        moe_imbalance: float = 1.0,
        experts: bool | None = None,
    ):
        super().__init__()
        self.attention_norm = RMSNorm(m.hidden_size)
        self.attention = Attention(m, seq_len, attention)
        self.ffn_norm = RMSNorm(m.hidden_size)
        experts = m.moe if experts is None else experts
        if experts:
            from harness.runner.moe import MoE

            self.moe = MoE(m, imbalance=moe_imbalance, feed_forward=FeedForward)
        else:
            self.feed_forward = FeedForward(m)
        self.mlp_name = "moe" if experts else "feed_forward"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + getattr(self, self.mlp_name)(self.ffn_norm(h))


def _run_blocks(blocks: list[nn.Module], h: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        h = block(h)
    return h


class Llama(nn.Module):
    """Token ids (batch, seq) → logits (batch, seq, vocab). Any of ``tok_embeddings``, ``norm`` and
    ``output`` may be None (a pipeline stage), in which case the input or output is hidden states."""

    def __init__(self, m: ModelSpec, *, seq_len: int, attention: str = "flash", moe_imbalance: float = 1.0):
        super().__init__()
        self.spec = m
        self.tok_embeddings: nn.Module | None = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    m, seq_len, attention, moe_imbalance=moe_imbalance, experts=m.block_has_experts(i)
                )
                for i in range(m.num_layers)
            }
        )
        self.norm: nn.Module | None = RMSNorm(m.hidden_size)
        self.output: nn.Module | None = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Consecutive layer keys run under one checkpoint (set by recompute.apply_recompute).
        self.checkpoint_groups: list[list[str]] = []
        # train.loss_chunks > 1: forward stops after the final norm; the loss runs the head
        # (parallel/loss.py, torchtitan's ``_skip_lm_head``).
        self.skip_head = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic, scale-aware initialisation (std 0.02; output projections scaled by depth) from
        the global RNG, in parameter order: for a model built whole on a real (or fake) device. The
        runner builds on the meta device and fills each rank's shards with :func:`initial_value`."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                nn.init.normal_(p, std=init_std(self.spec, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        grouped = {g[0]: g for g in self.checkpoint_groups}
        keys = list(self.layers.keys())
        i = 0
        while i < len(keys):
            group = grouped.get(keys[i])
            if group is None:
                h = self.layers[keys[i]](h)
                i += 1
            else:  # one checkpoint for the group: only h is kept, backward recomputes all its blocks at once
                blocks = [self.layers[k] for k in group]
                h = checkpoint(_run_blocks, blocks, h, use_reentrant=False, preserve_rng_state=False)
                i += len(group)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and not self.skip_head else h
