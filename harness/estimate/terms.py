"""The estimator's term names and the one sum that makes them a rank's peak (ESTIMATOR.md, STYLE.md 1)."""

from __future__ import annotations

from typing import NamedTuple

ENGINES = ("paper", "megatron", "torch")
STATE_TERMS = ("params", "grads", "optimizer")
ACTIVATION_TERMS = ("activations", "token_ids", "output_activations", "logits")
BUFFER_TERMS = (
    "param_copies",
    "fsdp_allgather",
    "grad_reduce",
    "tp_allgather",
    "pp_p2p",
    "cp_kv_allgather",
    "loss",
)
STEP_TERMS = ("step_grads", "optimizer_step")
TERMS = STATE_TERMS + ACTIVATION_TERMS + BUFFER_TERMS + STEP_TERMS
_FWD_BWD_TERMS = ACTIVATION_TERMS + BUFFER_TERMS
FLOPS_CONVENTION = "megatron"


def peak_bytes(terms: dict[str, int]) -> int:
    """The one sum: states + max(forward/backward terms, optimizer-step terms)."""
    get = terms.__getitem__
    step = sum(map(get, STEP_TERMS))
    return sum(map(get, STATE_TERMS)) + max(sum(map(get, _FWD_BWD_TERMS)), step)


class StageEstimate(NamedTuple):
    """Bytes of every term on one rank of pipeline stage ``stage`` (all terms present, zeros included)
    and their peak, ``peak_bytes(terms)``. A NamedTuple, not a frozen dataclass: ``plan`` creates tens
    of thousands, and a frozen dataclass's ``__init__`` costs several times more."""

    stage: int
    terms: dict[str, int]
    total_bytes: int

    @classmethod
    def of(cls, stage: int, terms: dict[str, int]) -> StageEstimate:
        return cls(stage, terms, peak_bytes(terms))
