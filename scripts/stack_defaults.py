"""The default answer checked where users get it: torchtitan's stack (what a GPU preset assumes) on
layouts of every axis at paper scale, the ``torch`` engine's allocated and reserved levels and the
default profile's calibrated reserved level against each layout's fake trace (allocated peak of the
worst traced rank, and its trace replayed through the caching-allocator model).

No published figure here (scripts/published_runs.py has those): the trace is the reference, as in the
paper-scale studies. One ``harness run run.mode=fake`` a layout (10-40 s each; about 4 minutes for the
list).

  python scripts/stack_defaults.py [--out results/published/torchtitan_defaults.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GIB = 1 << 30
HERE = Path(__file__).resolve().parent
COMMON = ["device=h100_94gb", "stack=torchtitan", "train.seq_len=8192"]
# (name, overrides): every axis once, at the widths torchtitan's recipes use
LAYOUTS = [
    ("Llama-3-8B FSDP 8, micro-batch 1", ["model=llama3_8b", "parallel.dp=8", "parallel.zero_stage=3"]),
    (
        "Llama-3-8B FSDP 8, micro-batch 2",
        ["model=llama3_8b", "parallel.dp=8", "parallel.zero_stage=3", "train.micro_batch_size=2"],
    ),
    (
        "Llama-3-8B tp 2 × FSDP 4, micro-batch 2",
        [
            "model=llama3_8b",
            "parallel.tp=2",
            "parallel.dp=4",
            "parallel.zero_stage=3",
            "train.micro_batch_size=2",
        ],
    ),
    (
        "Llama-3-8B cp 2 × FSDP 4, s 16k",
        ["model=llama3_8b", "parallel.cp=2", "parallel.dp=4", "parallel.zero_stage=3", "train.seq_len=16384"],
    ),
    (
        "Llama-3-8B tp 2 × pp 2 × FSDP 2",
        [
            "model=llama3_8b",
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero_stage=3",
            "train.num_microbatches=8",
        ],
    ),
    (
        "Llama-3-70B tp 8 × FSDP 8",
        ["model=llama3_70b", "parallel.tp=8", "parallel.dp=8", "parallel.zero_stage=3"],
    ),
    (
        "Llama-3-70B tp 8 × FSDP 8, full recomputation",
        [
            "model=llama3_70b",
            "parallel.tp=8",
            "parallel.dp=8",
            "parallel.zero_stage=3",
            "train.recompute=full",
        ],
    ),
    (
        "Llama-3-70B tp 4 × cp 2 × FSDP 4",
        ["model=llama3_70b", "parallel.tp=4", "parallel.cp=2", "parallel.dp=4", "parallel.zero_stage=3"],
    ),
    (
        "Llama-3-70B tp 8 × pp 4 × FSDP 2",
        [
            "model=llama3_70b",
            "parallel.tp=8",
            "parallel.pp=4",
            "parallel.dp=2",
            "parallel.zero_stage=3",
            "train.num_microbatches=8",
        ],
    ),
    (
        "Llama-3-70B tp 8 × pp 8",
        ["model=llama3_70b", "parallel.tp=8", "parallel.pp=8", "parallel.dp=1", "train.num_microbatches=8"],
    ),
]


def _published_runs():
    """scripts/published_runs.py, for its ``harness_json`` (one subprocess call, JSON back) and
    ``report``."""
    spec = importlib.util.spec_from_file_location("published_runs", HERE / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the table (Markdown) there too")
    args = ap.parse_args()
    published = _published_runs()
    run = published.harness_json
    lines = [
        "# torchtitan's default stack at paper scale: the predictions against fake traces",
        "",
        "Written by `python scripts/stack_defaults.py`. Each prediction with its error against the",
        "trace: the allocated levels against the worst traced rank's allocated peak, the reserved levels",
        "against its trace replayed through the caching-allocator model.",
        "",
        "| layout | traced allocated | engine allocated | replayed reserved | engine reserved "
        "| calibrated reserved |",
        "|---|---|---|---|---|---|",
    ]
    for i, (name, overrides) in enumerate(LAYOUTS, 1):
        print(f"[{i}/{len(LAYOUTS)}] {name} (tracing)", file=sys.stderr, flush=True)
        o = [*COMMON, *overrides]
        est = run("estimate", o)
        rec = run("run", [*o, "run.mode=fake"])
        alloc, res = rec.get("peak_allocated_bytes"), rec.get("sim_peak_reserved_bytes")
        # the reserved level as a trace's replay counts it: without the cuBLAS workspace (which the
        # profile's calibrated reserved level leaves out already: analysis/profile.py)
        workspace = est.get("cublas_workspace_bytes", 0)

        def cell(value, reference):
            if value is None or not reference:
                return "–"
            return f"{value / GIB:.1f} GiB ({value / reference - 1:+.1%})"

        calibrated = est.get("calibrated_reserved_total_bytes")
        lines.append(
            f"| {name} | {alloc / GIB:.1f} GiB | {cell(est['total_bytes'], alloc)} | {res / GIB:.1f} GiB | "
            f"{cell(est['reserved_total_bytes'] - workspace, res)} | "
            f"{cell(calibrated, res)} |"
        )
    lines += ["", "Common overrides: `" + " ".join(COMMON) + "`."]
    published.report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
