"""The analytical estimator: memory per rank (engines paper, megatron, torch) and FLOPs.

One function per term (``params``, ``states``, ``activations``, ``buffers``, ``paper``; bytes per element
in ``dtypes``), one stage composed
from them (``stage``) with its candidate peaks (``peaks``), the one sum (``terms``), the estimate of every
stage and the most-loaded rank (``core``), the reserved and device levels (``levels``), communication and
the step-time model (``comm``, ``steptime``), and the questions asked of many estimates (``plan``,
``solve``).

May import: harness.spec and the standard library; never torch, Hydra or pandas.
"""

from harness.estimate.core import Estimate, estimate
from harness.estimate.flops import model_flops_per_step, peak_tflops_for
from harness.estimate.params import stage_params, total_params
from harness.estimate.terms import ENGINES, STATE_TERMS, TERMS, StageEstimate

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
