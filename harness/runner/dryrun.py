"""A dry run: one process stands in for one rank of a layout — ``harness.runner.fake.trace.trace_rank`` with
the CPU's own kernels (what a real CPU run executes), kept for the tests that compare it with real runs.

Measured against real runs (tests/runner/test_dryrun.py): FSDP equal within 0.5 %; tensor parallelism a few
per cent high (fake collectives and the loss_parallel path hold temporaries the gloo run does not hold
at once); DDP through :class:`harness.runner.fake.ddp.BucketedReplica`. ``harness run run.mode=fake``
is the command; this is its single-rank core.
"""

from __future__ import annotations

from typing import Any

from harness.spec import RunSpec


def dry_run_peak(spec: RunSpec, *, rank: int = 0) -> dict[str, Any]:
    """Peak memory of ``rank`` for one measured step after one warm-up step, traced in this process
    with the CPU's kernels."""
    from harness.runner.fake.trace import trace_rank

    return trace_rank(spec, rank, kernels="cpu")
