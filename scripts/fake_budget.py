"""Budget of `harness run run.mode=fake`: seconds per traced rank and the tracing process's host memory,
and the traced peak beside the torch engine's estimate, term by term.

Targets (issue 14): Llama-2-7B to Llama-3-70B layouts under 60 s per traced rank, Llama-3.1-405B under
5 minutes, the tracing process under 4 GiB of host memory. Heavy: one layout at a time.
Run: python scripts/fake_budget.py [--kernels cuda|cpu] [override ...]
  e.g. python scripts/fake_budget.py model=llama3_8b device=h100_94gb parallel.dp=8 \\
       parallel.zero_stage=3 train.seq_len=8192 train.micro_batch_size=1 train.precision=bf16

Before and after a change to the fake mode: ``--compare REV`` traces each point (``--point "override
..."``, repeatable; default COMPARE_POINTS) with the harness of git revision REV and with this tree's,
``--repeats`` times each, each run a fresh process, and prints whether every figure of every traced
rank is the same (peaks, categories, the sim_* replay, partitions; not the timings) and the CPU
seconds of ``run_fake`` (the process and its tracing children, median) and its wall seconds.

What a study costs: ``--grid STUDY`` (e.g. paper_a100_40gb_fake) lists its points that the fake mode
traces, by model, with their traced ranks and the blocks × micro-batches those ranks run (a rank's
trace costs roughly a fixed part plus a part per block and micro-batch; sequence length and
micro-batch size change only shapes, which cost a fake tensor nothing). ``--rank R`` on a few sampled
points gives the CPU seconds per rank to multiply with.
"""

from __future__ import annotations

import argparse
import logging

from harness.cli.config import compose, run_spec
from harness.estimate import TERMS, estimate
from harness.runner.fake.run import run_fake

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
    ap.add_argument("--compare", metavar="REV", help="trace the points with revision REV and with this tree")
    ap.add_argument("--point", action="append", default=None, help='"override ..." (with --compare)')
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grid", metavar="STUDY", help="the traced ranks of sweeps/study/STUDY.yaml's points")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.grid:
        grid(args.grid)
        return
    if args.compare:
        points = [p.split() for p in (args.point or COMPARE_POINTS)]
        compare(args.compare, points, repeats=args.repeats, timeout_s=args.timeout)
        return
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
    """One rank's trace in a child process, forked after the imports as run_fake forks it: its seconds,
    CPU seconds, host memory and peak."""
    import time

    from harness.runner.fake.pool import _preload, _trace_in_child

    _preload()

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


def grid_points(study: str) -> list:
    """The canonical specs of a study's grid (sweeps/study/STUDY.yaml: its sweeper's params, each
    ``grids`` entry over them) that the fake mode traces; invalid points are left out."""
    import itertools
    from pathlib import Path

    import yaml

    from harness.runner.fake.run import fake_problems
    from harness.spec import DeviceSpec, InvalidSpec, ModelSpec, ParallelSpec, RunSpec, TrainSpec, canonical

    sweeps = Path(__file__).resolve().parents[1] / "sweeps"

    def preset(group: str, name: str) -> dict:
        return yaml.safe_load((sweeps / group / f"{name}.yaml").read_text())

    cfg = yaml.safe_load((sweeps / "study" / f"{study}.yaml").read_text())
    defaults = {k.split("/")[-1]: v for d in cfg["defaults"] for k, v in d.items()}
    sweeper = cfg["hydra"]["sweeper"]
    specs = {}
    for extra in sweeper.get("grids") or [{}]:
        params = {**sweeper["params"], **extra}
        keys = list(params)
        values = [str(params[k]).split(",") for k in keys]
        for combo in itertools.product(*values):
            point = dict(zip(keys, combo, strict=True))
            par = {k.split(".", 1)[1]: v for k, v in point.items() if k.startswith("parallel.")}
            par = {k: None if v == "null" else int(v) for k, v in par.items()}
            train = {**preset("train", defaults["train"])}
            train.update({k.split(".", 1)[1]: int(v) for k, v in point.items() if k.startswith("train.")})
            spec = RunSpec(
                ModelSpec(**preset("model", point.get("model", defaults["model"]))),
                ParallelSpec(**par),
                TrainSpec(**train),
                DeviceSpec(**preset("device", defaults["device"])),
            )
            try:
                spec = canonical(spec)
            except InvalidSpec:
                continue
            if not fake_problems(spec):
                specs[spec] = None
    return list(specs)


def grid(study: str) -> None:
    """Points, traced ranks and blocks × micro-batches per traced rank of a study, by model and layout."""
    from collections import defaultdict

    from harness.runner.fake.ranks import traced_ranks

    points = grid_points(study)
    rows: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for s in points:
        p = s.parallel
        ranks = len(traced_ranks(s)) + (1 if p.zero_stage == 1 and p.dp * p.cp > 1 else 0)
        key = (s.model.name, p.tp, p.cp, p.pp, s.model.num_layers // p.pp)
        row = rows[key]
        row[0] += 1
        row[1] += ranks
        row[2] += ranks * (s.model.num_layers // p.pp) * s.train.num_microbatches
    print(f"{study}: {len(points)} points the fake mode traces (a ZeRO-1 point counted with its extra rank)")
    print("model        tp cp pp blocks/stage  points  traced ranks  blocks x micro-batches")
    for (name, tp, cp, pp, blocks), (n, ranks, passes) in sorted(rows.items()):
        print(f"{name:12s} {tp:2d} {cp:2d} {pp:2d} {blocks:12d} {n:7d} {ranks:13d} {passes:23d}")
    total = [sum(r[i] for r in rows.values()) for i in range(3)]
    print(f"total{'':30s}{total[0]:7d} {total[1]:13d} {total[2]:23d}")


# A handful of layouts, cut to a few layers so that each traces in seconds here: tensor and pipeline
# parallelism on a 70B model, FSDP on an 8B one with recomputation, DDP with ZeRO-1 (which traces the
# largest partition's rank too), context parallelism with FSDP, and an interleaved schedule.
COMPARE_POINTS = [
    "model=llama3_70b model.num_layers=8 device=h100_94gb train=paper parallel.tp=8 parallel.pp=4 "
    "parallel.world_size=32 train.precision=bf16",
    "model=llama3_8b model.num_layers=2 device=h100_94gb parallel.dp=8 parallel.zero_stage=3 "
    "train.seq_len=4096 train.micro_batch_size=1 train.precision=bf16 train.recompute=full",
    "model=llama2_7b model.num_layers=2 device=a100_40gb parallel.dp=4 parallel.zero_stage=1 "
    "train.seq_len=2048 train.micro_batch_size=1 train.precision=bf16",
    "model=llama2_13b model.num_layers=4 device=a100_40gb parallel.dp=2 parallel.cp=2 "
    "parallel.zero_stage=3 train.seq_len=4096 train.micro_batch_size=1 train.precision=bf16",
    "model=tiny parallel.pp=2 parallel.pp_schedule=interleaved_1f1b parallel.virtual_stages=2 "
    "train.num_microbatches=4 parallel.tp=2",
]

# What differs run to run by nature: times, host memory, the environment.
VOLATILE = {"wall_s", "trace_s", "trace_cpu_s", "host_rss_bytes", "fake_trace_s", "fake_trace_cpu_s"}
VOLATILE_PREFIXES = ("env_", "fake_host_")

_COMPARE_CHILD = """
import json, resource, sys, time
from harness.cli.config import compose, run_spec
from harness.runner.fake import run as fake

ranks = []
record = fake.fake_record

def capture(spec, traced, **kw):
    ranks.extend(traced)
    return record(spec, traced, **kw)

fake.fake_record = capture
spec = run_spec(compose(json.loads(sys.argv[1])))

def cpu():
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

cpu0, wall0 = cpu(), time.perf_counter()
row = fake.run_fake(spec, timeout_s=float(sys.argv[2]))
out = {"row": row, "ranks": ranks, "cpu_s": cpu() - cpu0, "wall_s": time.perf_counter() - wall0}
print("RESULT " + json.dumps(out, default=str))
"""


def _volatile(key: str) -> bool:
    return key in VOLATILE or key.startswith(VOLATILE_PREFIXES)


def _figures(result: dict) -> dict:
    """What must not change: the row and every traced rank, less times, host memory and environment."""
    row = {k: v for k, v in result["row"].items() if not _volatile(k)}
    ranks = [
        {k: v for k, v in r.items() if not _volatile(k) and k != "exit_code"}
        for r in sorted(result["ranks"], key=lambda r: r["rank"])
    ]
    return {"row": row, "ranks": ranks}


def _differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}{k} only in {'new' if k in b else 'old'}")
            else:
                out += _differences(a[k], b[k], f"{path}{k}.")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}{i}.")]
    same = a == b or (a != a and b != b)  # (NaN, as a step-time spread of no steps is)
    return [] if same else [f"{path.rstrip('.')}: {a!r} != {b!r}"]


def _run_point(root: str, overrides: list[str], timeout_s: float) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPARE_CHILD, json.dumps(overrides), str(timeout_s)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(overrides)} in {root}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def compare(rev: str, points: list[list[str]], *, repeats: int, timeout_s: float) -> None:
    """Each point traced ``repeats`` times by revision ``rev`` and by this tree, alternately."""
    import statistics
    import subprocess
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="fake-budget-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(here), "archive", rev, "harness", "hydra_plugins", "sweeps"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print(f"old: {rev}; new: this tree; {repeats} runs each; CPU s of run_fake (median, min..max)")
        for overrides in points:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for _ in range(repeats):
                for side, root in (("old", tmp), ("new", str(here))):
                    runs[side].append(_run_point(root, overrides, timeout_s))
            diffs = []
            for r in runs["old"][1:] + runs["new"]:
                diffs += _differences(_figures(runs["old"][0]), _figures(r))
            row, old = runs["new"][0]["row"], runs["old"][0]["row"]
            print(" ".join(overrides))
            print(
                f"  status {row['status']}; traced ranks {row.get('fake_traced_ranks')}; peak "
                f"{row.get('peak_allocated_bytes')} B (old {old.get('peak_allocated_bytes')}); per-rank "
                f"{row.get('per_rank_peak_bytes')}; sim reserved {row.get('sim_peak_reserved_bytes')}"
            )
            print(f"  every figure equal: {'yes' if not diffs else 'NO'}")
            for d in sorted(set(diffs))[:20]:
                print(f"    {d}")
            for side in ("old", "new"):
                cpu = [r["cpu_s"] for r in runs[side]]
                wall = [r["wall_s"] for r in runs[side]]
                print(
                    f"  {side}: CPU {statistics.median(cpu):.1f} s ({min(cpu):.1f}..{max(cpu):.1f}), "
                    f"wall {statistics.median(wall):.1f} s"
                )


if __name__ == "__main__":
    main()
