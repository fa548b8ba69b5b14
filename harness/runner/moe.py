"""A mixture-of-experts feed-forward layer (issue 27): a top-k router, SwiGLU experts, optional shared
experts, with a deterministic routing so that a measurement is repeatable and every layout of the
same point routes the same tokens to the same experts.

What it keeps for backward follows torchtitan's MoE (``torchtitan/models/common/moe.py`` and
``token_dispatcher.py`` @ b5bcd76c; docs/mixture-of-experts.md §1): the router runs in FP32 (its
input's FP32 copy and the FP32 scores are kept), the routed rows are gathered into one (N, h) buffer
in the compute dtype (N = tokens · top-k), each expert's SwiGLU keeps its four (n_e, f) tensors, and
the combine multiplies the experts' output in FP32 by the gate values before it scatters it back
(``routed_out.to(fp32) * scores``: an FP32 (N, h) copy kept for the gates' gradient). The index
tensors (top-k ids, the sort order and each row's token) are int64 and made in every forward.

Experts are one ``FeedForward`` each (Megatron's ``SequentialMLP``, Hugging Face's Mixtral), run one
after another over their slice of the routed buffer: the same tensors a grouped GEMM keeps, with
each expert's weights a leaf parameter, so autocast casts each once per region as it does a dense
layer's (a slice of one 3-D parameter would be cast again in every micro-batch).

The routing (``train.moe_imbalance``, harness/spec/routing.py): which experts a token goes to is a
function of its position in the sequence, not of the router's scores, whose gate values still weight
the experts' outputs (so the router trains). With a random initialisation the learned top-k would
route a different, unrepeatable share to each expert; here the most-loaded expert (expert 0) takes
``moe_imbalance`` times the balanced share T·k/E and the others split the rest evenly. Dropless:
no token is dropped, whatever the imbalance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.spec.routing import expert_counts, routing_table


class _ScatterAdd(torch.autograd.Function):
    """``zeros(T, h).index_add(0, index, rows)`` whose backward keeps the index only: torch's own
    ``index_add`` saves ``rows`` too (an (N, h) FP32 tensor per layer), torchtitan's
    ``deterministic_scatter_add`` (``torchtitan/ops/scatter_add.py``) does not. Written here because
    torch has no such op."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, tokens: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return rows.new_zeros(tokens, rows.shape[1]).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class MoE(nn.Module):
    """Router, ``num_experts`` SwiGLU experts of ``moe_ffn_hidden_size``, optional shared experts (one
    SwiGLU of ``moe_ffn_hidden_size · num_shared_experts``, torchtitan's and DeepSeek's sizing) on every
    token, added to the routed output."""

    def __init__(self, m, *, imbalance: float, feed_forward: type[nn.Module]):
        super().__init__()
        self.top_k = m.experts_per_token
        self.score = m.moe_router
        self.norm_topk = m.moe_norm_topk
        self.router = nn.Linear(m.hidden_size, m.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [feed_forward(m, ffn_hidden_size=m.moe_ffn_hidden_size) for _ in range(m.num_experts)]
        )
        shared = m.moe_ffn_hidden_size * m.num_shared_experts
        self.shared = feed_forward(m, ffn_hidden_size=shared) if shared else None
        self.table = routing_table(m.num_experts, m.experts_per_token, imbalance)
        # The global positions of this rank's tokens (None: 0 … s − 1); context parallelism sets them.
        self.positions: list[int] | None = None
        self._counts: dict[tuple[int, int], list[int]] = {}
        self._ids: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _routing(self, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Each token's experts (T, k) int64, a new tensor in every forward as torchtitan's top-k is
        (repeated over the batch from one sequence's, made once per device: no per-step host work), and
        the rows each expert receives (Python ints, so the split is static: no host sync, and a fake run
        traces it)."""
        positions = self.positions if self.positions is not None else list(range(seq))
        if (seq, device) not in self._ids:
            rows = [self.table[p % len(self.table)] for p in positions]
            self._ids[(seq, device)] = torch.tensor(rows, device=device)
        if (batch, seq) not in self._counts:
            self._counts[(batch, seq)] = expert_counts(self.table, positions, batch)
        return self._ids[(seq, device)].repeat(batch, 1), self._counts[(batch, seq)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        with torch.autocast(x.device.type, enabled=False):  # torchtitan's router runs in FP32
            logits = F.linear(flat.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        ids, counts = self._routing(b, s, x.device)
        gates = scores.gather(1, ids)
        if self.norm_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        order = ids.flatten().argsort(stable=True)  # expert-major rows; row r is token order[r] // k
        tokens = order // self.top_k
        dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        )
        routed = flat.index_select(0, tokens).to(dtype)
        out = torch.cat(
            [expert(rows) for expert, rows in zip(self.experts, routed.split(counts), strict=True)]
        )
        weighted = out.float() * gates.flatten().index_select(0, order).unsqueeze(1)
        combined = _ScatterAdd.apply(weighted, tokens, b * s)
        y = combined.to(x.dtype).view(b, s, h)
        return y + self.shared(x) if self.shared is not None else y
