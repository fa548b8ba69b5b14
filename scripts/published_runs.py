"""Published GPU runs of a stack against this project's predictions (issues 28 and 32).

Each run below is a published measurement of the most memory the caching allocator reserved
(``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``, what torchtitan logs as "memory"), with its
source and the layout, training shape and stack that reproduce it here. Only runs whose every
memory-level choice this project models are listed: no torch.compile, no Float8 (both change the
kernels and the tensors they keep).

For each run it prints the ``torch`` engine's allocated and reserved levels (``harness estimate``, the
named stack) and the reserved level with the default GPU profile; with ``--trace``, also the worst
traced rank's allocated peak and its trace replayed through the caching-allocator model (``harness run
run.mode=fake``, one to two minutes a run). Each figure is given as a ratio to the published one.

Run: python scripts/published_runs.py [--trace] [--out results/published/torchtitan_h100.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GIB = 1 << 30
TORCHTITAN_2024 = (
    "pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, torch 2024-12-23)"
)
# What torchtitan's llama3_8b.toml at 9dec370 sets, and the benchmark's text: sequence 8192, local batch
# size 2, selective activation checkpointing per operator ('op'), FSDP2 with BF16 parameters and FP32
# reduction, AdamW (foreach), H100 with 96 GB of HBM2e (the paper's h100_94gb preset: 93.6 GiB).
# Its FSDP2 wrapping (parallelisms/parallelize_llama.py ``apply_fsdp``) is one root unit (embedding,
# final norm, head) resharded after forward, as this runner's ``always``; it also keeps the last block
# gathered after forward, which ``always`` reshards (one layer's BF16 weights, 416 MiB, not modelled).
# Today's torchtitan (``default``, the head a unit of its own) is stack=torchtitan's default. It had no
# chunked loss then (``ChunkedLossWrapper`` came in 2026): the whole loss at once.
TORCHTITAN_8B = [
    "model=llama3_8b",
    "device=h100_94gb",
    "stack=torchtitan",
    "parallel.zero_stage=3",
    "parallel.fsdp_reshard_after_forward=always",
    "train.loss_chunks=1",
    "train.seq_len=8192",
    "train.micro_batch_size=2",
    "train.precision=bf16",
]
RUNS = [
    {
        "name": "Llama 3.1 8B, FSDP 8",
        "source": f"{TORCHTITAN_2024}, Table 1, row FSDP",
        "published_gib": 82.4,
        "overrides": [*TORCHTITAN_8B, "parallel.dp=8"],
    },
    {
        "name": "Llama 3.1 8B, FSDP 128",
        "source": f"{TORCHTITAN_2024}, Table 3, row FSDP",
        "published_gib": 67.0,
        "overrides": [*TORCHTITAN_8B, "parallel.dp=128"],
    },
]


def harness_json(command: str, overrides: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "harness", command, *overrides, "format=json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def measure(run: dict, trace: bool) -> dict:
    est = harness_json("estimate", run["overrides"])
    row = {
        "engine allocated": est["total_bytes"],
        "engine reserved": est["reserved_total_bytes"],
        "calibrated reserved": est.get("calibrated_reserved_total_bytes"),
        "config_id": est["config_id"],
    }
    if trace:
        rec = harness_json("run", [*run["overrides"], "run.mode=fake"])
        row["traced allocated"] = rec.get("peak_allocated_bytes")
        row["replayed reserved"] = rec.get("sim_peak_reserved_bytes")
        row["status"] = rec.get("status")
    return row


def table(results: list[tuple[dict, dict]]) -> str:
    cols = [
        "engine allocated",
        "engine reserved",
        "calibrated reserved",
        "traced allocated",
        "replayed reserved",
    ]
    cols = [c for c in cols if any(r.get(c) is not None for _, r in results)]
    lines = [
        "| run | published reserved | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for run, r in results:
        pub = run["published_gib"]
        cells = [
            "–" if r.get(c) is None else f"{r[c] / GIB:.1f} GiB ({r[c] / GIB / pub - 1:+.1%})" for c in cols
        ]
        lines.append(f"| {run['name']} | {pub:.1f} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="also trace each run with run.mode=fake")
    ap.add_argument("--out", type=Path, help="write the report (Markdown) there too")
    args = ap.parse_args()
    results = []
    for i, run in enumerate(RUNS, 1):
        print(
            f"[{i}/{len(RUNS)}] {run['name']}{' (tracing)' if args.trace else ''}",
            file=sys.stderr,
            flush=True,
        )
        results.append((run, measure(run, args.trace)))
    lines = [
        "# Published GPU runs against the predictions",
        "",
        "Written by `python scripts/published_runs.py"
        + (" --trace" if args.trace else "")
        + "`. Each figure with its ratio to the published max reserved memory.",
        "",
        table(results),
        "",
        "Sources and overrides:",
        "",
    ]
    for run, r in results:
        lines.append(
            f"- {run['name']}: {run['source']}; `{' '.join(run['overrides'])}` (config_id {r['config_id']})"
        )
    report("\n".join(lines) + "\n", args.out)
    return 0


def report(text: str, out: Path | None) -> None:
    """Print a Markdown report, and write it to ``out`` too where given (its folder made)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
