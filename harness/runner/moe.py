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

With expert parallelism (``parallel.ep``, harness/runner/parallel/expert.py) a rank holds 1/ep of the
experts: the routed rows go to their expert's rank and come back with two autograd all-to-alls, whose
splits follow from the routing of every rank of the ep group (Python ints: no host sync).

The routing (``train.moe_imbalance``, harness/spec/routing.py): which experts a token goes to is a
function of its position in the sequence, not of the router's scores, whose gate values still weight
the experts' outputs (so the router trains). With a random initialisation the learned top-k would
route a different, unrepeatable share to each expert; here the most-loaded expert (expert 0) takes
``moe_imbalance`` times the balanced share T·k/E and the others split the rest evenly. Dropless:
no token is dropped, whatever the imbalance.

The load-balancing loss (``model.moe_aux_loss_coeff`` > 0) trains the router toward balance as
Megatron's and Hugging Face's auxiliary loss does; the routing above stays as it is (the scores still
weight the outputs). Its gradient joins in backward (:class:`_LoadBalancingLoss`); it keeps no tensor
the router does not keep already (the scores' mean needs only their shape in backward), so it adds no
memory term.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

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


class _LoadBalancingLoss(torch.autograd.Function):
    """Megatron's ``MoEAuxLossAutoScaler`` (megatron/core/transformer/moe/moe_utils.py): the layer's output
    unchanged, and in backward the load-balancing loss's gradient ``scale``, the training loop's own
    scale of the loss (1/micro-batches, or 1 where the pipeline schedule scales the gradients), as if
    the loss had been added to the language-model loss. So no loss value crosses a pipeline stage, and
    the reported loss stays the language model's (Megatron logs the load-balancing loss apart).
    Written here because torch has no such op; it keeps the 0-d loss only."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class Experts(nn.ModuleDict):
    """A rank's experts, keyed by their global index, each run over its slice of the expert-major rows:
    one module with a forward of its own, so that FSDP2 makes a block's experts one unit with one
    forward hook, as torchtitan's ``GroupedExperts`` is (harness/runner/parallel/data.py)."""

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat(
            [expert(part) for expert, part in zip(self.values(), rows.split(counts), strict=True)]
        )


class _Dispatch(NamedTuple):
    """An expert-parallel rank's all-to-all for one shape: rows it sends to / receives from each member
    of its ep group, rows per local expert, and the received rows' expert-major order and its inverse."""

    send: list[int]
    recv: list[int]
    local: list[int]
    order: torch.Tensor
    inverse: torch.Tensor


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
        # Keyed by the global expert index (the same parameter names as a list), so that an expert-
        # parallel rank keeps its share under the names, and the initial values, of the whole model.
        self.experts = Experts(
            {str(i): feed_forward(m, ffn_hidden_size=m.moe_ffn_hidden_size) for i in range(m.num_experts)}
        )
        self.num_experts = m.num_experts
        # Expert parallelism (harness/runner/parallel/expert.py): this rank's place in its ep group and
        # each member's token positions; 1 and None without.
        self.ep, self.ep_rank, self.ep_group = 1, 0, None
        self.sources: list[list[int]] = []
        self._plans: dict[tuple[int, int, torch.device], _Dispatch] = {}
        shared = m.moe_ffn_hidden_size * m.num_shared_experts
        self.shared = feed_forward(m, ffn_hidden_size=shared) if shared else None
        self.table = routing_table(m.num_experts, m.experts_per_token, imbalance)
        # The load-balancing loss (``model.moe_aux_loss_coeff``): its coefficient, and the training
        # loop's scale of the loss, which harness/runner/parallel/compose.py sets (set_aux_loss_scale).
        self.aux_loss_coeff = m.moe_aux_loss_coeff
        self.aux_loss_scale = 1.0
        self._shares: dict[torch.device, torch.Tensor] = {}
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

    def load_balancing_loss(self, scores: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's loss (Fedus et al. 2022, eq. 4; Megatron's
        ``switch_load_balancing_loss_func``): coefficient · E · Σ_i f_i · P_i, P_i the router's mean
        probability for expert i over this rank's tokens, f_i expert i's share of the routed rows. Here
        f_i is the share the deterministic routing gives it (the routing table's: one period of E
        positions), the same on every rank: the mean over the data- and context-parallel ranks, which
        the gradients' averaging takes, is then the loss of the whole batch (Megatron's global variant),
        so every layout trains as one rank would."""
        shares = self._shares.get(scores.device)
        if shares is None:
            counts = expert_counts(self.table, list(range(len(self.table))), 1)
            total = sum(counts)
            shares = self._shares[scores.device] = torch.tensor(
                [c / total for c in counts], dtype=torch.float32, device=scores.device
            )
        return self.aux_loss_coeff * self.num_experts * (scores.mean(dim=0) * shares).sum()

    def shard_experts(self, group, *, rank: int, size: int, sources: list[list[int]]) -> None:
        """Keep experts rank·E/size … (rank + 1)·E/size − 1 (expert parallelism) and route over ``group``;
        ``sources``: the token positions of each member of the group, in group-rank order."""
        per = self.num_experts // size
        for i in range(self.num_experts):
            if not rank * per <= i < (rank + 1) * per:
                del self.experts[str(i)]
        self.ep, self.ep_rank, self.ep_group, self.sources = size, rank, group, sources

    def _dispatch(self, batch: int, seq: int, device: torch.device) -> _Dispatch:
        """The all-to-all's splits and the permutations around it, from every member's routing (made
        once per shape and device)."""
        key = (batch, seq, device)
        if key not in self._plans:
            per = self.num_experts // self.ep
            counts = [expert_counts(self.table, positions, batch) for positions in self.sources]
            send = [sum(counts[self.ep_rank][j * per : (j + 1) * per]) for j in range(self.ep)]
            mine = [c[self.ep_rank * per : (self.ep_rank + 1) * per] for c in counts]  # [source][expert]
            recv = [sum(rows) for rows in mine]
            # The received rows are source-major (each source's rows expert-major); the experts want
            # expert-major: row order for expert e, then source j.
            starts, at = [], 0
            for rows in mine:
                starts.append([at + sum(rows[:e]) for e in range(per)])
                at += sum(rows)
            order = [starts[j][e] + r for e in range(per) for j in range(self.ep) for r in range(mine[j][e])]
            inverse = [0] * len(order)
            for position, row in enumerate(order):
                inverse[row] = position
            local = [sum(mine[j][e] for j in range(self.ep)) for e in range(per)]
            self._plans[key] = _Dispatch(
                send, recv, local, torch.tensor(order, device=device), torch.tensor(inverse, device=device)
            )
        return self._plans[key]

    def _experts(self, routed: torch.Tensor, counts: list[int], batch: int, seq: int) -> torch.Tensor:
        """The experts' output for the routed rows (expert-major, every expert's), in the same order;
        with expert parallelism the rows go to the rank holding their expert and come back."""
        if self.ep == 1:
            return self.experts(routed, counts)
        plan = self._dispatch(batch, seq, routed.device)
        received = all_to_all_single_autograd(routed, plan.recv, plan.send, self.ep_group)
        out = self.experts(received.index_select(0, plan.order), plan.local)
        return all_to_all_single_autograd(
            out.index_select(0, plan.inverse), plan.send, plan.recv, self.ep_group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        weight = self.router.weight
        if isinstance(weight, DTensor):  # tensor parallelism: replicated, the same on every tp rank
            weight = weight.to_local()
        with torch.autocast(x.device.type, enabled=False):  # torchtitan's router runs in FP32
            logits = F.linear(flat.float(), weight.float())
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
        out = self._experts(routed, counts, b, s)
        weighted = out.float() * gates.flatten().index_select(0, order).unsqueeze(1)
        combined = _ScatterAdd.apply(weighted, tokens, b * s)
        y = combined.to(x.dtype).view(b, s, h)
        if self.aux_loss_coeff:
            y = _LoadBalancingLoss.apply(y, self.load_balancing_loss(scores), self.aux_loss_scale)
        return y + self.shared(x) if self.shared is not None else y
