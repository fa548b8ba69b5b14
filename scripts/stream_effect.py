"""How much the CUDA streams of a step's allocations move its replayed reserved peak (issue 13 item 2).

Runs one point (a real CPU run, or ``--fake`` a fake one) with its allocation trace recorded, then replays
each rank's trace through harness/alloc twice: with the streams the runner gave each allocation
(FSDP2's all-gather copy-in stream 1, reduce-scatter stream 2) and with every allocation on stream 0.
Prints one line per rank: allocated peak, reserved peak both ways, and the difference.
Run: python scripts/stream_effect.py model=tiny parallel.dp=2 parallel.zero_stage=3 train.seq_len=512
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from harness.alloc import load_trace, replay
from harness.cli.config import compose, run_spec

MIB = 2**20


def fake_traces(spec) -> list[tuple[str, list[dict]]]:
    """Rank 0's trace of a fake run (the one its sim_* figures replay)."""
    from harness.runner.fake.trace import trace_rank

    return [("fake rank0", trace_rank(spec, 0, keep_trace=True)["trace"])]


def real_traces(spec, tmp: Path) -> list[tuple[str, list[dict]]]:
    from harness.runner.supervisor import run_point

    record = run_point(
        spec, timeout_s=600, artifacts={"trace_dir": tmp, "write_trace": True, "memory_snapshot": False}
    )
    if record["status"] != "ok":
        raise SystemExit(f"the run failed: {record['status']}: {record['error']}")
    return [(Path(f).name.split(".")[-3], load_trace(f)) for f in record["trace_files"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for harness run")
    parser.add_argument("--fake", action="store_true", help="trace a fake run instead of a real CPU one")
    args = parser.parse_args()
    spec = run_spec(compose(args.overrides))
    with tempfile.TemporaryDirectory() as tmp:
        traces = fake_traces(spec) if args.fake else real_traces(spec, Path(tmp))
    head = ("rank", "allocs by stream", "allocated", "reserved", "all on 0", "moves")
    print(f"{head[0]:<11} {head[1]:<28} {head[2]:>10} {head[3]:>10} {head[4]:>10} {head[5]:>9}")
    for name, events in traces:
        streams = dict(sorted(Counter(e["stream"] for e in events if e["action"] == "alloc").items()))
        tagged, untagged = replay(events), replay([{**e, "stream": 0} for e in events])
        moves = tagged.peak_reserved_bytes - untagged.peak_reserved_bytes
        print(
            f"{name:<11} {streams!s:<28} {tagged.peak_allocated_bytes / MIB:>6.1f} MiB"
            f" {tagged.peak_reserved_bytes / MIB:>6.1f} MiB {untagged.peak_reserved_bytes / MIB:>6.1f} MiB"
            f" {moves / MIB:>+5.1f} MiB ({moves / untagged.peak_reserved_bytes:+.1%})"
        )


if __name__ == "__main__":
    main()
