"""Every pipeline rank of a few `tiny` layouts traced (`run.mode=fake`, the CPU's kernels, which equal a
real CPU run here) against the torch engine's estimate of its stage. The studies compare each point's
worst rank only; this looks at the others (README, "The estimator").
Run: python scripts/pipeline_ranks.py [override ...]   (extra overrides apply to every layout)
"""

from __future__ import annotations

import multiprocessing
import sys

from harness.cli.config import compose, run_spec
from harness.estimate import estimate
from harness.runner.fake.pool import _preload
from harness.runner.fake.ranks import rank_of
from harness.runner.fake.trace import trace_rank

BASE = [
    "model=tiny",
    "train.seq_len=512",
    "train.micro_batch_size=4",
    "parallel.pp=2",
    "train.num_microbatches=2",
]
LAYOUTS = [
    [],
    ["train.recompute=full"],
    ["train.precision=bf16"],
    ["parallel.tp=2"],
    ["parallel.pp=4", "model.num_layers=8", "train.num_microbatches=4"],
    ["parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2", "train.num_microbatches=4"],
    ["parallel.dp=2", "parallel.zero_stage=3"],
]


def _trace(spec, rank: int, queue) -> None:
    queue.put(trace_rank(spec, rank)["peak_allocated_bytes"])


def main() -> None:
    extra = sys.argv[1:]
    _preload()
    ctx = multiprocessing.get_context("fork")  # a fake process group per process, as run_fake does
    print("layout | per pipeline rank: traced B vs engine B (engine error)")
    for layout in LAYOUTS:
        spec = run_spec(compose([*BASE, "train.precision=fp32", *layout, *extra]))
        est = estimate(spec, engine="torch")
        cells = []
        for stage in range(spec.parallel.pp):
            queue = ctx.Queue()
            proc = ctx.Process(target=_trace, args=(spec, rank_of(spec, stage=stage), queue))
            proc.start()
            traced = queue.get()
            proc.join()
            engine = next(s for s in est.stages if s.stage == stage).total_bytes
            cells.append(f"{stage}: {traced} vs {engine} ({(engine - traced) / traced:+.1%})")
        print(f"{' '.join(layout) or 'pp 2 (base)'} | " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
