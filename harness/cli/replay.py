"""`harness replay trace=PATH`: a trace through the caching-allocator model, its peaks printed."""

from __future__ import annotations

import json
from collections.abc import Sequence

from harness.cli.config import compose


def _int_or_none(value, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive number of bytes (or null)")
    if value == float("inf"):
        return None
    if value != int(value):  # issue 29: 1.5 was silently 1 byte
        raise ValueError(f"{key}={value!r} must be a whole number of bytes")
    return int(value)


def replay_command(overrides: Sequence[str]) -> int:
    from harness.alloc.trace import load_trace_file, replay

    cfg = compose(overrides)
    fmt = cfg["format"]
    if fmt not in ("table", "json"):
        raise ValueError(f"format={fmt!r} must be table or json")
    if not cfg.get("trace"):
        raise ValueError("trace=PATH is required (a JSON trace, a snapshot dict or a _dump_snapshot pickle)")
    r = cfg["replay"]
    expandable = r["expandable_segments"]
    if not isinstance(expandable, bool):
        raise ValueError(f"replay.expandable_segments={expandable!r} must be true or false")
    split = r["max_split_size_mb"]
    if split is not None and (
        isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 < split < float("inf")
    ):
        raise ValueError(f"replay.max_split_size_mb={split!r} must be a finite number of MiB > 0 (or null)")
    options = dict(
        capacity_bytes=_int_or_none(r["capacity_bytes"], "replay.capacity_bytes"),
        max_split_size_mb=split,
        expandable_segments=expandable,
    )
    events, initial = load_trace_file(str(cfg["trace"]))
    if initial:  # a CUDA run's timed window: the allocator's state at its start comes first
        options["initial_segments"] = initial
    result = replay(events, **options)
    judged = None
    capacity = options["capacity_bytes"]
    if capacity is not None:  # what the card would say (issue 32)
        from harness.alloc import capacity_verdict

        # The tensors' own peak: the bounded replay's where it ran to the end, else an unbounded one's.
        allocated = (
            replay(events, **{**options, "capacity_bytes": None}) if result.num_ooms else result
        ).peak_allocated_bytes
        judged = capacity_verdict(result, capacity, peak_allocated_bytes=allocated)
    if fmt == "json":
        extra = {"capacity_verdict": judged} if judged else {}
        print(json.dumps({"trace": str(cfg["trace"]), **result.as_dict(), **extra}, indent=2))
        return 0
    # The segments at the reserved peak: a second, deterministic replay stopped at that event.
    if result.reserved_peak_event is not None:
        result.segments_at_reserved_peak = replay(
            events, stop_at=result.reserved_peak_event, **options
        ).segments_at_reserved_peak
    print(replay_table(result))
    if judged:
        from harness.cli.render.common import capacity_words, human

        print(
            f"on a card of {human(options['capacity_bytes'])}: "
            f"{capacity_words(judged, result.num_alloc_retries)}"
        )
    return 0


def replay_table(result) -> str:
    from harness.cli.render.common import human as human_bytes

    lines = [
        f"events replayed:      {result.num_events}",
        f"peak allocated:       {human_bytes(result.peak_allocated_bytes)}",
        f"peak reserved:        {human_bytes(result.peak_reserved_bytes)}"
        + (f"  (event {result.reserved_peak_event})" if result.reserved_peak_event is not None else ""),
        f"fragmentation:        {human_bytes(result.fragmentation_bytes)}"
        "  (reserved minus allocated at the reserved peak)",
        f"segments opened:      {result.num_segments_opened}",
        f"alloc retries:        {result.num_alloc_retries}",
        f"out of memory:        {result.num_ooms}"
        + (f"  (at event {result.oom_event})" if result.oom_event is not None else ""),
    ]
    segs = result.segments_at_reserved_peak
    if segs:
        lines += [
            "",
            "segments at the reserved peak:",
            f"{'pool':6} {'stream':>8} {'size':>12} {'allocated':>12} {'blocks':>7}  free in segment",
        ]
        # The largest segments first: they are where the fragmentation is.
        for s in sorted(segs, key=lambda s: -s["size"])[:40]:
            free = human_bytes(s["size"] - s["allocated"])
            lines.append(
                f"{s['pool']:6} {s['stream']:>8} {human_bytes(s['size']):>12} "
                f"{human_bytes(s['allocated']):>12} {s['blocks']:>7}  {free}"
            )
        if len(segs) > 40:
            lines.append(f"... and {len(segs) - 40} smaller segments")
    return "\n".join(lines)
