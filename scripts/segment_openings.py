"""Which requests open the caching allocator's segments in a trace, and what sits in the large ones.

Replays a trace (``run.trace=true`` writes one per traced rank) through the allocator model
(harness/alloc) and prints every segment opened by a request of at least ``--min-mib``, with the
allocated and reserved level after it. With ``--at EVENT`` (or ``--at peak``: the allocated peak) it
also stops there and lists, for each
segment of at least ``--segment-mib``, its free blocks and its live blocks grouped by size and by the
event range that allocated them (``--ranges``: boundaries, e.g. the end of the first backward). How the
reserved-level mechanisms in docs/gpu-memory.md were read from fake traces.

  python scripts/segment_openings.py TRACE [--min-mib 100] [--at EVENT|peak --segment-mib 2000 --ranges 3400]
"""

from __future__ import annotations

import argparse
import bisect
from collections import Counter

from harness.alloc.allocator import CachingAllocator
from harness.alloc.trace import load_trace

MIB = 1 << 20


def peak_event(events: list[dict]) -> int:
    """The event at which the allocated level peaks (the first, on ties)."""
    a, live, best = CachingAllocator(), {}, (0, 0)
    for i, e in enumerate(events):
        if e["action"] == "alloc" and e["size"]:
            live[e["addr"]] = a.malloc(e["size"], e.get("stream") or 0)
            if a.allocated > best[0]:
                best = (a.allocated, i)
        elif e["action"] == "free_completed" and live.get(e["addr"]) is not None:
            a.free_block(live.pop(e["addr"]))
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-mib", type=float, default=100.0, help="segments opened by requests this large")
    ap.add_argument("--at", default=None, help="stop before this event (or 'peak'); list the large segments")
    ap.add_argument("--segment-mib", type=float, default=1000.0, help="segments this large are listed")
    ap.add_argument("--ranges", type=int, nargs="*", default=[], help="event boundaries of the phases")
    args = ap.parse_args()
    events = load_trace(args.trace)
    stop = len(events) if args.at is None else peak_event(events) + 1 if args.at == "peak" else int(args.at)
    a = CachingAllocator()
    live: dict[int, object] = {}
    born: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events[:stop]):
        if e["action"] == "alloc":
            if e["size"] == 0:
                live[e["addr"]] = None
                continue
            before = a.opened
            b = a.malloc(e["size"], e.get("stream") or 0)
            live[e["addr"]], born[id(b)] = b, (i, e["size"])
            if a.opened > before and e["size"] >= args.min_mib * MIB:
                print(
                    f"{i:7d} opened {b.segment.size / MIB:9.1f} MiB on stream {e.get('stream') or 0} for "
                    f"{e['size'] / MIB:9.1f} MiB: allocated {a.allocated / 2**30:6.2f} GiB, "
                    f"reserved {a.reserved / 2**30:6.2f} GiB"
                )
        elif e["action"] == "free_completed":
            b = live.pop(e["addr"])
            if b is not None:
                a.free_block(b)
    levels = f"reserved {a.reserved / 2**30:.2f} GiB, allocated {a.allocated / 2**30:.2f} GiB"
    print(f"{levels} after event {stop - 1}")
    if args.at is None:
        return
    bounds = sorted(args.ranges)
    for seg in sorted(a.segments.values(), key=lambda s: s.addr):
        if seg.size < args.segment_mib * MIB:
            continue
        blocks = list(seg.blocks())
        free = [round(b.size / MIB) for b in blocks if not b.allocated]
        used = Counter()
        for b in blocks:
            if b.allocated:
                i, size = born[id(b)]
                used[(round(size / MIB), f"range {bisect.bisect_right(bounds, i)}")] += 1
        shown = ", ".join(f"{n} x {s} MiB ({r})" for (s, r), n in sorted(used.items()))
        print(f"segment {seg.size / MIB:.0f} MiB (stream {seg.stream}): free {free}; live {shown or 'none'}")


if __name__ == "__main__":
    main()
