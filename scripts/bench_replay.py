"""Benchmark: events per second of the caching-allocator replay (harness/alloc).

Builds a synthetic trace shaped like a training step (many live activations of a few dozen sizes,
small temporaries freed at once, a few large buffers; two streams) of ``--events`` events, replays it
``--repeats`` times and prints the median time, events per second and the target (a million events in
under 10 s on the project's 2-core machine). Run: python scripts/bench_replay.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from harness.alloc import replay

MiB = 1 << 20


def synthetic_trace(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shapes = [rng.choice([4096, 65536, 512 * 1024, 3 * MiB, 8 * MiB, 24 * MiB, 96 * MiB]) for _ in range(40)]
    live: list[tuple[int, int]] = []
    out: list[dict] = []
    addr = 1
    while len(out) < n:
        if live and (len(live) > 2000 or rng.random() < 0.48):
            # Mostly last-in first-out (temporaries), sometimes an older block (saved activations).
            i = len(live) - 1 if rng.random() < 0.7 else rng.randrange(len(live))
            a, stream = live.pop(i)
            out.append({"action": "free_completed", "addr": a, "size": 0, "stream": stream})
        else:
            stream = 1 if rng.random() < 0.1 else 0
            size = rng.choice(shapes) + rng.randrange(0, 4096)
            out.append({"action": "alloc", "addr": addr, "size": size, "stream": stream})
            live.append((addr, stream))
            addr += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    events = synthetic_trace(args.events)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = replay(events)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(
        f"events: {len(events):,}  peak reserved {result.peak_reserved_bytes / 2**30:.2f} GiB, "
        f"segments opened {result.num_segments_opened}"
    )
    print(
        f"replay: median {median:.2f} s of {args.repeats} ({', '.join(f'{t:.2f}' for t in times)})  "
        f"= {len(events) / median:,.0f} events/s"
    )
    print(f"target: 1,000,000 events in < 10 s → {'met' if median * 1e6 / len(events) < 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
