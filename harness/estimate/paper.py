"""Engine `paper`: the published closed form of Fujii, Watanabe, Yokota 2024 (arXiv 2411.06465), exactly.

ESTIMATOR.md §6. Per GPU of the first pipeline stage, Megatron-LM with sequence parallelism, the
distributed optimizer, FlashAttention and no recomputation:

  states = (6 + 12/(d·c)) · ( h·v/t + (2L/p)·h²·( (1 + k/a + 1.5·f/h)/t + 1/h ) )
  acts   = s·b·h/(t·c) · ( (12 + 4k/a + 8f/h)·L + 8p + 4·(1 + v/h) )
  total  = states + acts

Kept as written, quirks included (engine `megatron` fixes them): one h·v term only (the untied head is
missing when p = 1); the output layer's 4·(1 + v/h) belongs to the last stage but is added to the
first; ``8p`` is probably Megatron's int64 token ids (8·s·b·p) written inside the s·b·h bracket. The form
has no ZeRO stage, recomputation, pipeline schedule, attention kernel or precision: those spec fields
are ignored (:data:`IGNORED_FIELDS`). Each term is rounded to the nearest byte, so the terms add up to
:func:`paper_total` within two bytes.
"""

from __future__ import annotations

from fractions import Fraction

from harness.spec import ModelSpec, ParallelSpec, TrainSpec

IGNORED_FIELDS = (
    "parallel.zero_stage",
    "parallel.pp_schedule",
    "parallel.virtual_stages",
    "train.num_microbatches",
    "train.recompute",
    "train.recompute_every",
    "train.recompute_method",
    "train.precision",
    "train.attention",
    "train.loss_chunks",
)


def paper_params(m: ModelSpec, p: ParallelSpec) -> int:
    """The paper's parameter count per rank: h·v/t + (2L/p)·h²·((1 + k/a + 1.5·f/h)/t + 1/h).

    Expanded, (L/p)·(2h²(1 + k/a) + 3hf)/t + 2h·L/p: exact integers under the validated divisibility.
    """
    h, layers = m.hidden_size, m.num_layers // p.pp
    matrices = 2 * h * h + 2 * h * (h // m.num_heads * m.num_kv_heads) + 3 * h * m.ffn_hidden_size
    return h * m.vocab_size // p.tp + layers * (matrices // p.tp + 2 * h)


def paper_terms(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> dict[str, int]:
    """The closed form split into the project's term names (all on stage 0, as the paper computes it)."""
    n = paper_params(m, p)
    h, k, a, f, v = m.hidden_size, m.num_kv_heads, m.num_heads, m.ffn_hidden_size, m.vocab_size
    unit = Fraction(t.seq_len * t.micro_batch_size * h, p.tp * p.cp)  # s·b·h/(t·c)
    layer_coef = 12 + Fraction(4 * k, a) + Fraction(8 * f, h)
    return {
        "params": 2 * n,
        "grads": 4 * n,
        "optimizer": round(Fraction(12 * n, p.dp * p.cp)),
        "activations": round(unit * layer_coef * m.num_layers),
        "token_ids": round(unit * 8 * p.pp),
        "output_activations": round(unit * 4),
        "logits": round(unit * Fraction(4 * v, h)),
    }


def paper_total(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> Fraction:
    """The closed form's total in bytes, as an exact fraction (for tests and reports)."""
    h, k, a, f, v = m.hidden_size, m.num_kv_heads, m.num_heads, m.ffn_hidden_size, m.vocab_size
    L, s, b = m.num_layers, t.seq_len, t.micro_batch_size
    d, tp, pp, c = p.dp, p.tp, p.pp, p.cp
    states = (6 + Fraction(12, d * c)) * (
        Fraction(h * v, tp)
        + Fraction(2 * L, pp) * h * h * ((1 + Fraction(k, a) + Fraction(3 * f, 2 * h)) / tp + Fraction(1, h))
    )
    acts = Fraction(s * b * h, tp * c) * (
        (12 + Fraction(4 * k, a) + Fraction(8 * f, h)) * L + 8 * pp + 4 * (1 + Fraction(v, h))
    )
    return states + acts
