"""The reverse questions of ``plan``: the fewest devices on which some layout fits, and the largest
micro-batch and the longest sequence that fit one given layout.

Each answer is a search over the estimate (calibrated when ``PlanOptions.calibration`` is set), judged
against the same threshold as ``plan``. Memory grows with the micro-batch and with the sequence (every
activation term is linear in b and in s, the score matrices of ``attention=math`` quadratic in s), so
the largest fitting value is found by doubling, then bisection; the device count has no such order
(divisibility decides which layouts exist), so it is scanned upwards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from harness.estimate.core import estimate
from harness.estimate.levels import verdict_bytes
from harness.estimate.plan import PlanOptions, PlanResult, PlanRow, plan
from harness.spec import RunSpec, canonical

QUESTIONS = ("min_gpus", "max_micro_batch", "max_seq_len")
SEQ_GRANULE = 128  # max_seq_len answers in multiples of 128 tokens (and of what the layout needs)


@dataclass(frozen=True)
class Solution:
    """The answer to one reverse question. ``answer`` None: nothing fits within the range searched."""

    question: str
    answer: int | None
    best: PlanRow | None  # the estimate at the answer (min_gpus: the best-ranked fitting layout)
    over: PlanRow | None  # the first value past the answer, which does not fit (None: the search limit)
    tried: tuple[int, ...]  # the values estimated, in order
    plan: PlanResult | None = None  # min_gpus: the whole plan at the answer


def device_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """The device counts below a node that ``min_gpus`` tries first: powers of two (1, 2, 4 with 8 per
    node), at most ``max_gpus``."""
    return [n for n in (2**i for i in range(32)) if n < gpus_per_node and n <= max_gpus]


def min_gpus(base: RunSpec, opts: PlanOptions, *, max_gpus: int) -> Solution:
    """The fewest devices on which ``plan`` finds a fitting layout: powers of two below a node, then
    whole nodes, doubling (1, 2, 4, … nodes, and ``max_gpus``'s whole nodes last) until one fits,
    then bisecting between the last count that did not and the first that did. Whole nodes are
    searched by bisection on the understanding that more devices never take a fitting layout away
    (each axis's degree can stay as it was while dp grows); issue 31: every node count one by one took
    72 tries for Llama-3.1-405B, and ``plan.max_gpus`` of a million would have taken hours."""
    if max_gpus < 1:
        raise ValueError(f"plan.max_gpus={max_gpus} must be >= 1")
    tried: list[int] = []

    def attempt(n: int):
        tried.append(n)
        result = plan(base, dataclasses.replace(opts, gpus=n))
        return result if result.fitting else None

    for n in device_counts(base.device.gpus_per_node, max_gpus):
        result = attempt(n)
        if result:
            return Solution("min_gpus", n, result.fitting[0], None, tuple(tried), result)
    node, most = base.device.gpus_per_node, max_gpus // base.device.gpus_per_node
    bad, good, found, k = 0, None, None, 1
    while k <= most and found is None:
        found = attempt(k * node)
        if found:
            good = k
        else:
            bad, k = k, (k * 2 if k * 2 <= most or k == most else most)
    if found is None:
        return Solution("min_gpus", None, None, None, tuple(tried))
    while good - bad > 1:
        mid = (good + bad) // 2
        result = attempt(mid * node)
        if result:
            good, found = mid, result
        else:
            bad = mid
    return Solution("min_gpus", good * node, found.fitting[0], None, tuple(tried), found)


def _row(spec: RunSpec, opts: PlanOptions) -> PlanRow:
    est = estimate(spec, engine=opts.engine)
    calibrated = None if opts.calibration is None else opts.calibration.total_bytes(est)
    device = verdict_bytes(est, opts.calibration)
    return PlanRow(est, None, device / est.capacity_bytes <= opts.threshold, calibrated, device)


def _largest(
    at: Callable[[int], PlanRow], limit: int
) -> tuple[int | None, PlanRow | None, PlanRow | None, list]:
    """The largest k in [1, limit] with ``at(k).fits``, for a fit that only gets worse as k grows:
    doubling from 1, then bisection. Returns (k, its row, the row of k+1's bracket end, tried)."""
    tried = [1]
    first = at(1)
    if not first.fits:
        return None, None, first, tried
    good, best, over, bad = 1, first, None, limit + 1
    while good * 2 <= limit:
        k = good * 2
        tried.append(k)
        row = at(k)
        if not row.fits:
            bad, over = k, row
            break
        good, best = k, row
    while bad - good > 1:
        k = (good + bad) // 2
        if k > limit:
            break
        tried.append(k)
        row = at(k)
        if row.fits:
            good, best = k, row
        else:
            bad, over = k, row
    return good, best, over, tried


def max_micro_batch(base: RunSpec, opts: PlanOptions, *, limit: int = 4096) -> Solution:
    """The largest ``train.micro_batch_size`` that fits ``base``'s layout (micro-batches per step as
    given)."""
    base = canonical(base)

    def at(b: int) -> PlanRow:
        return _row(
            dataclasses.replace(base, train=dataclasses.replace(base.train, micro_batch_size=b)), opts
        )

    answer, best, over, tried = _largest(at, limit)
    return Solution("max_micro_batch", answer, best, over, tuple(tried))


def seq_granule(spec: RunSpec) -> int:
    """The step of ``max_seq_len``: 128 tokens, made a multiple of what the layout needs (2·cp chunks
    under load-balanced context parallelism, then tp for sequence parallelism)."""
    p = spec.parallel
    need = 2 * p.cp if (p.cp > 1 and p.cp_load_balance) else p.cp
    if p.tp > 1 and p.sequence_parallel:
        need = math.lcm(need, p.cp * p.tp)
    return math.lcm(SEQ_GRANULE, need)


def max_seq_len(base: RunSpec, opts: PlanOptions, *, limit_tokens: int = 2**22) -> Solution:
    """The longest ``train.seq_len`` (a multiple of :func:`seq_granule`) that fits ``base``'s layout."""
    base = canonical(base)
    step = seq_granule(base)

    def at(k: int) -> PlanRow:
        train = dataclasses.replace(base.train, seq_len=k * step)
        return _row(dataclasses.replace(base, train=train), opts)

    k, best, over, tried = _largest(at, max(1, limit_tokens // step))
    return Solution(
        "max_seq_len", None if k is None else k * step, best, over, tuple(t * step for t in tried)
    )
