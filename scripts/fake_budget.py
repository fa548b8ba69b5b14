"""Budget of `harness run run.mode=fake`: seconds per traced rank and the tracing process's host memory,
and the traced peak beside the torch engine's estimate, term by term.

Targets (issue 14): Llama-2-7B to Llama-3-70B layouts under 60 s per traced rank, Llama-3.1-405B under
5 minutes, the tracing process under 4 GiB of host memory. Heavy: one layout at a time.
Run: python scripts/fake_budget.py [--kernels cuda|cpu] [override ...]
  e.g. python scripts/fake_budget.py model=llama3_8b device=h100_94gb parallel.dp=8 \\
       parallel.zero_stage=3 train.seq_len=8192 train.micro_batch_size=1 train.precision=bf16
"""

from __future__ import annotations

import argparse
import logging

from harness.cli.config import compose, run_spec
from harness.estimate import TERMS, estimate
from harness.runner.fake import run_fake

GIB = 2**30
DEFAULT = [
    "model=llama3_8b",
    "device=h100_94gb",
    "parallel.dp=8",
    "parallel.zero_stage=3",
    "train.seq_len=8192",
    "train.micro_batch_size=1",
    "train.precision=bf16",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--rank", type=int, default=None, help="trace this rank only (timing one stage)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = run_spec(compose(args.overrides or DEFAULT))
    if args.rank is not None:
        one_rank(spec, args.rank, args.kernels)
        return
    row = run_fake(spec, timeout_s=args.timeout, kernels=args.kernels)
    print(f"status {row['status']}  {row.get('error') or ''}")
    if row.get("peak_allocated_bytes") is None:
        return
    times = ", ".join(f"{s:.1f}" for s in row["fake_trace_s"])
    cpu = ", ".join(f"{s:.1f}" for s in row["fake_trace_cpu_s"])
    print(
        f"traced ranks {row['fake_traced_ranks']} ({row['fake_kernels']} kernels): {times} s each "
        f"({cpu} CPU s); "
        f"wall {row['wall_s']:.1f} s; tracing process max RSS {row['fake_host_rss_bytes'] / GIB:.2f} GiB"
    )
    est = estimate(spec, engine="torch")
    print(
        f"peak {row['peak_allocated_bytes'] / GIB:.3f} GiB on rank {row['worst_rank']}; "
        f"torch engine {est.total_bytes / GIB:.3f} GiB (stage {est.worst.stage})"
    )
    cats = {k[4:-6]: v for k, v in row.items() if k.startswith("mem_") and k.endswith("_bytes")}
    print("fake categories (GiB): " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in cats.items() if v))
    print(
        "engine terms (GiB):    "
        + ", ".join(f"{k} {est.worst.terms[k] / GIB:.3f}" for k in TERMS if est.worst.terms[k])
    )


def one_rank(spec, rank: int, kernels: str | None) -> None:
    """One rank's trace in a child process: its seconds, CPU seconds, host memory and peak."""
    import time

    from harness.runner.fake import _trace_in_child

    r = _trace_in_child(spec, rank, deadline=time.monotonic() + 3600, kernels=kernels)
    if "peak_allocated_bytes" not in r:
        print(f"rank {rank}: {r.get('error') or 'timed out'}")
        return
    print(
        f"rank {rank} ({r['kernels']} kernels): {r['trace_s']:.1f} s ({r['trace_cpu_s']:.1f} CPU s), "
        f"max RSS {r['host_rss_bytes'] / GIB:.2f} GiB, peak {r['peak_allocated_bytes'] / GIB:.3f} GiB"
    )
    print("categories (GiB): " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in r["categories"].items() if v))
    from harness.estimate import estimate

    stage = r["coords"]["pp"]
    est = next(x for x in estimate(spec, engine="torch").stages if x.stage == stage)
    print(
        f"torch engine, stage {stage}: {est.total_bytes / GIB:.3f} GiB; "
        + ", ".join(f"{k} {v / GIB:.3f}" for k, v in est.terms.items() if v)
    )


if __name__ == "__main__":
    main()
