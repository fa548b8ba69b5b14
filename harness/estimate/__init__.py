"""The analytical estimator: memory per rank (engines paper, megatron, torch) and FLOPs. No torch here."""

from harness.estimate.core import (
    ENGINES,
    STATE_TERMS,
    TERMS,
    Estimate,
    StageEstimate,
    estimate,
)
from harness.estimate.flops import model_flops_per_step, peak_tflops_for
from harness.estimate.params import stage_params, total_params

__all__ = [
    "ENGINES",
    "STATE_TERMS",
    "TERMS",
    "Estimate",
    "StageEstimate",
    "estimate",
    "model_flops_per_step",
    "peak_tflops_for",
    "stage_params",
    "total_params",
]
