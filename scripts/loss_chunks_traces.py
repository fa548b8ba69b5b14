"""The chunked loss (``train.loss_chunks``) traced against the ``torch`` engine: docs/stacks.md's table.

Each layout is Llama-3-8B cut to 2 layers at sequence 8192, BF16, on an H100 preset, traced with
``run.mode=fake`` (CUDA's kernels) unchunked and with 8 slices, and estimated with 8 slices. Prints one
Markdown row per layout: both traced peaks (the worst traced rank's allocated peak) and the engine's
figure with its difference. A few seconds a layout.

Run: python scripts/loss_chunks_traces.py
"""

from __future__ import annotations

from harness.cli.config import compose
from harness.estimate import estimate
from harness.runner.fake.run import run_fake
from harness.spec import canonical, config_spec

MIB = 1 << 20
LAYOUTS = {
    "one rank": [],
    "dp 8, ZeRO-3 (either policy)": ["parallel.dp=8", "parallel.zero_stage=3"],
    "dp 8, ZeRO-3, `op`": ["parallel.dp=8", "parallel.zero_stage=3", "train.recompute=op"],
    "pp 2 × dp 4, ZeRO-3, 2 micro-batches": [
        "parallel.pp=2",
        "parallel.dp=4",
        "parallel.zero_stage=3",
        "train.num_microbatches=2",
    ],
    "pp 2 × dp 4, ZeRO-3, 4 micro-batches": [
        "parallel.pp=2",
        "parallel.dp=4",
        "parallel.zero_stage=3",
        "train.num_microbatches=4",
    ],
    "cp 2 × dp 4, ZeRO-3": ["parallel.cp=2", "parallel.dp=4", "parallel.zero_stage=3"],
    "dp 4, ZeRO-3, micro-batch 2": ["parallel.dp=4", "parallel.zero_stage=3", "train.micro_batch_size=2"],
    "tp 2 × dp 4, ZeRO-3": ["parallel.tp=2", "parallel.dp=4", "parallel.zero_stage=3"],
    "tp 4 × dp 2, ZeRO-3, `op`": [
        "parallel.tp=4",
        "parallel.dp=2",
        "parallel.zero_stage=3",
        "train.recompute=op",
    ],
    "tp 2 without sequence parallelism": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "pp 2 × tp 2 × dp 2, ZeRO-3, 2 micro-batches": [
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.zero_stage=3",
        "train.num_microbatches=2",
    ],
    "dp 8, ZeRO-1 (DDP)": ["parallel.dp=8", "parallel.zero_stage=1"],
    "dp 4, ZeRO-0 (DDP), 2 micro-batches": [
        "parallel.dp=4",
        "parallel.zero_stage=0",
        "train.num_microbatches=2",
    ],
    "pp 2 × dp 4, ZeRO-0, 2 micro-batches": ["parallel.pp=2", "parallel.dp=4", "train.num_microbatches=2"],
    "pp 2, GPipe, 2 micro-batches": [
        "parallel.pp=2",
        "parallel.pp_schedule=gpipe",
        "train.num_microbatches=2",
    ],
    "dp 8, ZeRO-2, 2 micro-batches": ["parallel.dp=8", "parallel.zero_stage=2", "train.num_microbatches=2"],
    "dp 8, ZeRO-3, `op`, 2 micro-batches, `every_microbatch`": [
        "parallel.dp=8",
        "parallel.zero_stage=3",
        "parallel.fsdp_reshard_after_forward=default",
        "train.num_microbatches=2",
        "train.recompute=op",
        "train.grad_sync=every_microbatch",
    ],
}
# Fixed, so that no stack fills in another choice: the runner's own, as the table's rows were traced.
BASE = [
    "model=llama3_8b",
    "model.num_layers=2",
    "device=h100_80gb",
    "stack=harness",
    "train.seq_len=8192",
    "train.precision=bf16",
    "train.recompute=none",
]


def point(layout: list[str], chunks: int):
    over = [*BASE, f"train.loss_chunks={chunks}"]
    keys = {o.split("=")[0] for o in layout}
    over = [o for o in over if o.split("=")[0] not in keys] + layout
    return canonical(config_spec(compose(over)))


def main() -> None:
    print("| layout | unchunked traced | chunked traced | engine | |")
    print("|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        rows = {c: run_fake(point(layout, c)) for c in (1, 8)}
        bad = [r["error"] for r in rows.values() if r["status"] != "ok"]
        if bad:
            raise SystemExit(f"{name}: {bad[0]}")
        traced = {c: r["peak_allocated_bytes"] / MIB for c, r in rows.items()}
        engine = estimate(point(layout, 8)).total_bytes / MIB
        print(
            f"| {name} | {traced[1]:,.0f} MiB | {traced[8]:,.0f} | {engine:,.0f} | "
            f"{(engine / traced[8] - 1) * 100:+.1f} % |",
            flush=True,
        )


if __name__ == "__main__":
    main()
