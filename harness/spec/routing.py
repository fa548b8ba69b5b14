"""The deterministic routing of the mixture-of-experts layer (issue 27), shared by the runner's layer
(harness/runner/moe.py) and the estimator: which experts each token goes to, as a function of its
position in the sequence, and the rows each expert receives on a rank. Pure arithmetic on Python ints:
a fake run traces it without reading a tensor back, and the estimator counts the same rows."""

from __future__ import annotations

from functools import lru_cache


def routing_table(num_experts: int, top_k: int, imbalance: float) -> list[list[int]]:
    """The experts of the tokens at positions p ≡ 0 … E − 1 (mod E), ``top_k`` distinct ones each:
    expert 0 in the first round(imbalance · k) rows (k rows: the balanced share), the other experts in
    turn over the remaining places, so each of them appears as evenly as the rest allows. (Validation
    requires imbalance · k to be whole and at most E.)"""
    e, k = num_experts, top_k
    hot = round(imbalance * k)
    others = list(range(1, e))
    table, turn = [], 0
    for row in range(e):
        picks = [0] if row < hot else []
        while len(picks) < k:
            picks.append(others[turn % len(others)])
            turn += 1
        table.append(picks)
    return table


def expert_counts(table: list[list[int]], positions: list[int], batch: int) -> list[int]:
    """Rows each expert receives from ``batch`` sequences of the tokens at ``positions``."""
    counts = [0] * len(table)
    rows = len(table)
    for p in positions:
        for expert in table[p % rows]:
            counts[expert] += batch
    return counts


def local_position_list(seq_len: int, *, rank: int, cp: int, load_balance: bool) -> list[int]:
    """Global positions of the tokens context-parallel rank ``rank`` of ``cp`` holds, in its order
    (head–tail with ``load_balance``: chunks r and 2·cp − 1 − r of 2·cp), as Python ints: the runner's
    ``parallel/context.py`` makes its index tensor from them, and a fake run's tensors cannot be read
    back."""
    if not load_balance:
        chunk = seq_len // cp
        return list(range(rank * chunk, (rank + 1) * chunk))
    chunk = seq_len // (2 * cp)
    tail_start = (2 * cp - 1 - rank) * chunk
    return list(range(rank * chunk, (rank + 1) * chunk)) + list(range(tail_start, tail_start + chunk))


@lru_cache(maxsize=4096)
def rank_expert_rows(
    num_experts: int,
    top_k: int,
    imbalance: float,
    *,
    seq_len: int,
    batch: int,
    cp: int,
    load_balance: bool,
    cp_rank: int = 0,
) -> list[int]:
    """Rows each expert receives from one micro-batch on context-parallel rank ``cp_rank`` (a tuple,
    cached: ``plan`` asks for the same few shapes across thousands of layouts, and counting a sequence's
    positions each time was most of its time for a mixture of experts)."""
    positions = (
        local_position_list(seq_len, rank=cp_rank, cp=cp, load_balance=load_balance)
        if cp > 1
        else list(range(seq_len))
    )
    return tuple(expert_counts(routing_table(num_experts, top_k, imbalance), positions, batch))
