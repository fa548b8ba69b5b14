"""The caching-allocator model, rule by rule, on hand-built traces whose answers are worked out below."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.alloc import CachingAllocator, OutOfMemory, TraceError, load_trace, replay, round_size
from harness.cli.main import main

MiB = 1 << 20


def alloc(addr: int, size: int, stream: int = 0) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "stream": stream}


def free(addr: int, stream: int = 0) -> dict:
    return {"action": "free_completed", "addr": addr, "size": 0, "stream": stream}


def test_requests_are_rounded_to_512_bytes():
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]


def test_small_requests_share_a_2_mib_segment():
    # Two 1000 B requests: each rounds to 1024 B, both in the first 2 MiB small segment (split, as the
    # remainder is >= 512 B); then 1 MiB exactly is still small: it fits the same segment's remainder.
    r = replay([alloc(1, 1000), alloc(2, 1000), alloc(3, MiB)])
    assert r.peak_reserved_bytes == 2 * MiB
    assert r.peak_allocated_bytes == 1024 + 1024 + MiB
    assert r.num_segments_opened == 1


def test_large_pool_segment_sizes():
    # 1 MiB + 1 B is large: below 10 MiB it opens a 20 MiB segment; 10 MiB opens exactly 10 MiB (rounded
    # to 2 MiB); 13 MiB opens 14 MiB.
    assert replay([alloc(1, MiB + 1)]).peak_reserved_bytes == 20 * MiB
    assert replay([alloc(1, 10 * MiB)]).peak_reserved_bytes == 10 * MiB
    assert replay([alloc(1, 13 * MiB)]).peak_reserved_bytes == 14 * MiB


def test_large_pool_unsplit_remainder_counts_as_allocated():
    # 13 MiB in a 14 MiB segment: the 1 MiB remainder is not > 1 MiB, so the block is not split and the
    # whole 14 MiB counts as allocated (torch.cuda.max_memory_allocated counts block sizes).
    r = replay([alloc(1, 13 * MiB)])
    assert r.peak_allocated_bytes == 14 * MiB
    # 9 MiB in a 20 MiB segment: the 11 MiB remainder is split off; 9 MiB allocated.
    assert replay([alloc(1, 9 * MiB)]).peak_allocated_bytes == 9 * MiB


def test_small_pool_splits_any_remainder_of_512_bytes():
    # 1 MiB opens a 2 MiB small segment (remainder 1 MiB split off); 1 MiB - 612 B rounds to
    # 1 MiB - 512 B and leaves exactly 512 B: split too (small pool: remainder >= kMinBlockSize), so a
    # 1 B request (512 B) fills the same segment exactly.
    r = replay([alloc(1, MiB), alloc(2, MiB - 612), alloc(3, 1)])
    assert r.peak_allocated_bytes == 2 * MiB
    assert r.peak_reserved_bytes == 2 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    # Cached: a 12 MiB and a 14 MiB segment, both free. 11 MiB takes the 12 MiB one (remainder 1 MiB,
    # unsplit: 12 MiB allocated), 13 MiB the 14 MiB one; nothing new is opened (reserved stays 26 MiB).
    # Worst fit would have put 11 MiB in the 14 MiB block and opened a third segment for 13 MiB.
    r = replay(
        [alloc(1, 12 * MiB), alloc(2, 14 * MiB), free(1), free(2), alloc(3, 11 * MiB), alloc(4, 13 * MiB)]
    )
    assert r.peak_reserved_bytes == 26 * MiB
    assert r.num_segments_opened == 2
    assert r.peak_allocated_bytes == 26 * MiB


def test_free_blocks_merge_inside_their_segment_only():
    # One 20 MiB segment: 2 MiB + 2 MiB + the 16 MiB rest. Freeing both merges the segment back to one
    # 20 MiB block, so 19 MiB fits it (reserved stays 20 MiB).
    within = replay([alloc(1, 2 * MiB), alloc(2, 2 * MiB), free(1), free(2), alloc(3, 19 * MiB)])
    assert within.peak_reserved_bytes == 20 * MiB
    # Two 12 MiB segments, both free: 24 MiB of free blocks, but not adjacent in one segment, so 20 MiB
    # opens a segment of its own: 12 + 12 + 20 = 44 MiB.
    across = replay([alloc(1, 12 * MiB), alloc(2, 12 * MiB), free(1), free(2), alloc(3, 20 * MiB)])
    assert across.peak_reserved_bytes == 44 * MiB


def test_blocks_are_never_shared_across_streams():
    # A free 12 MiB segment on stream 7 does not serve a 12 MiB request on stream 8.
    r = replay([alloc(1, 12 * MiB, stream=7), free(1, stream=7), alloc(2, 12 * MiB, stream=8)])
    assert r.peak_reserved_bytes == 24 * MiB


def test_capacity_releases_cached_segments_then_retries_then_runs_out():
    # Capacity 40 MiB. 12 MiB is cached after its free; 30 MiB would make 42 MiB: the allocator releases
    # the empty cached segment and retries (a retry): 30 MiB reserved. Then 20 MiB more would make
    # 50 MiB with nothing cached to release: the retry is made (a second one) and fails: out of memory.
    r = replay([alloc(1, 12 * MiB), free(1), alloc(2, 30 * MiB), alloc(3, 20 * MiB)], capacity_bytes=40 * MiB)
    assert r.num_alloc_retries == 2
    assert r.num_ooms == 1
    assert r.oom_event == 3
    assert r.peak_reserved_bytes == 30 * MiB


def test_a_split_segment_is_not_released():
    # The 20 MiB segment still holds a live 2 MiB block: releasing cannot free it, so 30 MiB more at a
    # 40 MiB capacity is an out-of-memory. The retry after release_cached_blocks is made (and counted)
    # all the same: that function always reports success.
    r = replay([alloc(1, 2 * MiB), alloc(2, 3 * MiB), free(2), alloc(3, 30 * MiB)], capacity_bytes=40 * MiB)
    assert r.num_ooms == 1
    assert r.num_alloc_retries == 1


def test_zero_byte_requests_never_reach_the_allocator():
    r = replay([alloc(1, 0), alloc(2, 100), free(1)])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (512, 2 * MiB)


def test_max_split_size():
    # max_split_size 64 MiB: a cached 100 MiB block is oversize. A 30 MiB request may not split it (a
    # new 30 MiB segment opens: 130 MiB reserved); a 90 MiB request may take it whole (100 < 90 + 20).
    events = [alloc(1, 100 * MiB), free(1), alloc(2, 30 * MiB), alloc(3, 90 * MiB)]
    r = replay(events, max_split_size_mb=64)
    assert r.peak_reserved_bytes == 130 * MiB
    assert r.peak_allocated_bytes == 130 * MiB  # the 90 MiB request holds the whole 100 MiB block
    # Without the setting, 30 MiB splits the 100 MiB block and 90 MiB opens a segment: 190 MiB.
    assert replay(events).peak_reserved_bytes == 190 * MiB
    with pytest.raises(ValueError, match="must be >= 20"):
        replay([], max_split_size_mb=19)


def test_max_split_size_releases_oversize_blocks_before_everything_else():
    # Capacity 150 MiB, max_split_size 64 MiB: a cached oversize 100 MiB block and a live 20 MiB segment.
    # 80 MiB does not fit (200 > 150); release_available_cached_blocks frees the 100 MiB block, and the
    # 80 MiB segment opens without counting a retry (only the attempt after release_cached_blocks counts).
    events = [alloc(1, 100 * MiB), alloc(2, 2 * MiB), free(1), alloc(3, 80 * MiB)]
    r = replay(events, max_split_size_mb=64, capacity_bytes=150 * MiB)
    assert r.num_ooms == 0
    assert r.num_alloc_retries == 0
    assert r.peak_reserved_bytes == 120 * MiB


def test_expandable_segments_grow_one_segment():
    # Three 2 MiB requests map one 20 MiB page of the large pool's expandable segment; 30 MiB extends
    # the trailing 14 MiB free block by 16 MiB, which maps one more 20 MiB page: 40 MiB reserved.
    # Ordinary segments: 20 MiB + a 30 MiB segment = 50 MiB.
    events = [alloc(1, 2 * MiB), alloc(2, 2 * MiB), alloc(3, 2 * MiB), alloc(4, 30 * MiB)]
    assert replay(events, expandable_segments=True).peak_reserved_bytes == 40 * MiB
    assert replay(events).peak_reserved_bytes == 50 * MiB


def test_fragmentation_is_reserved_minus_allocated_at_the_reserved_peak():
    # 9 MiB in a 20 MiB segment (11 MiB split off and cached), then 12 MiB opens a 12 MiB segment:
    # reserved 32 MiB, allocated 21 MiB: fragmentation 11 MiB.
    r = replay([alloc(1, 9 * MiB), alloc(2, 12 * MiB)])
    assert (r.peak_reserved_bytes, r.fragmentation_bytes) == (32 * MiB, 11 * MiB)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([free(5)], "event 0: free_completed at 0x5, which was never allocated"),
        ([alloc(1, 10), alloc(2, -4)], "event 1 .*size -4"),
        ([alloc(1, 10), alloc(1, 10)], "event 1: alloc at 0x1, which is already allocated"),
        ([{"addr": 1}], "event 0: not an object with an 'action'"),
    ],
)
def test_malformed_traces_name_the_event(events, message):
    with pytest.raises(TraceError, match=message):
        replay(events)


def test_other_actions_are_ignored():
    events = [
        {"action": "segment_alloc", "addr": 9, "size": 99},
        alloc(1, 10),
        {"action": "free_requested", "addr": 1, "size": 10},
        free(1),
    ]
    assert replay(events).peak_allocated_bytes == 512


def test_trace_files_json_snapshot_and_pickle(tmp_path):
    events = [alloc(1, 12 * MiB), free(1)]
    (tmp_path / "list.json").write_text(json.dumps(events))
    (tmp_path / "snap.json").write_text(json.dumps({"segments": [], "device_traces": [[], events]}))
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    for name in ("list.json", "snap.json", "snap.pickle"):
        assert load_trace(tmp_path / name) == events
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TraceError, match="is not JSON"):
        load_trace(tmp_path / "bad.json")


def test_replay_command_prints_json_and_refuses_bad_traces(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([alloc(1, 12 * MiB), free(1), alloc(2, 30 * MiB)]))
    assert main(["replay", f"trace={path}", "replay.capacity_bytes=41943040", "format=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_reserved_bytes"] == 30 * MiB and out["num_alloc_retries"] == 1  # as above
    assert out["num_ooms"] == 0 and out["peak_allocated_bytes"] == 30 * MiB
    assert out["capacity_verdict"] == "fits_after_flush"  # issue 32: what the card would do
    assert main(["replay", f"trace={path}"]) == 0
    assert "segments at the reserved peak" in capsys.readouterr().out
    assert main(["replay", f"trace={path}", "replay.capacity_bytes=41943040"]) == 0
    assert "on a card of 40.0 MiB: fits only after 1 cache flush(es)" in capsys.readouterr().out
    path.write_text(json.dumps([free(3)]))
    assert main(["replay", f"trace={path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "event 0" in err


# --- properties ---------------------------------------------------------------------------------------
sizes = st.one_of(st.integers(0, 4096), st.integers(0, 3 * MiB), st.integers(0, 64 * MiB))
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1), st.integers(0, 10_000)), max_size=120)


def _events(program) -> list[dict]:
    """A valid trace from (is_alloc, size, stream, pick): frees pick one of the live addresses."""
    live, out, nxt = [], [], 1
    for is_alloc, size, stream, pick in program:
        if is_alloc or not live:
            out.append(alloc(nxt, size, stream))
            live.append((nxt, stream))
            nxt += 1
        else:
            addr, s = live.pop(pick % len(live))
            out.append(free(addr, s))
    return out


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([None, 64 * MiB, 256 * MiB]), st.sampled_from([None, 40]), st.booleans())
def test_properties_of_any_trace(program, capacity, max_split, expandable):
    events = _events(program)
    a = CachingAllocator(capacity_bytes=capacity, max_split_size_mb=max_split, expandable_segments=expandable)
    live = {}
    for ev in events:
        if ev["action"] == "alloc":
            try:
                live[ev["addr"]] = a.malloc(ev["size"], ev["stream"])
            except OutOfMemory:
                break
        else:
            a.free_block(live.pop(ev["addr"]))
        # Reserved memory holds every allocated block; it never passes the capacity.
        assert a.reserved >= a.allocated >= 0
        assert capacity is None or a.reserved <= capacity
        # Blocks tile their segments exactly.
        for seg in a.segments.values():
            assert sum(b.size for b in seg.blocks()) == seg.size
    kwargs = dict(capacity_bytes=capacity, max_split_size_mb=max_split, expandable_segments=expandable)
    assert replay(events, **kwargs) == replay(events, **kwargs)  # deterministic


def test_replay_from_a_snapshots_segments_reuses_their_cache_and_starts_its_peaks_there():
    """``initial_segments`` (issue 33): a 20 MiB segment with 4 MiB held and 16 MiB cached serves an
    8 MiB request without a new segment; the peaks start at the seeded state (4 MiB allocated, 20 MiB
    reserved), as reset_peak_memory_stats sets them; freeing the held block works by its address."""
    from harness.alloc import replay

    mib, seg = 1 << 20, 0x7F00_0000_0000
    segments = [
        {
            "address": seg,
            "total_size": 20 * mib,
            "stream": 0,
            "segment_type": "large",
            "blocks": [
                {"address": seg, "size": 4 * mib, "state": "active_allocated"},
                {"address": seg + 4 * mib, "size": 16 * mib, "state": "inactive"},
            ],
        }
    ]
    events = [
        {"action": "alloc", "addr": 1, "size": 8 * mib, "stream": 0},
        {"action": "free_completed", "addr": seg, "size": 4 * mib, "stream": 0},
    ]
    r = replay(events, initial_segments=segments)
    assert (r.num_segments_opened, r.peak_reserved_bytes, r.peak_allocated_bytes) == (0, 20 * mib, 12 * mib)
    empty = replay(events[:1], initial_segments=segments[:0])
    assert empty.num_segments_opened == 1  # from an empty cache the same request opens one
    idle = replay([], initial_segments=segments)
    assert (idle.peak_reserved_bytes, idle.peak_allocated_bytes) == (20 * mib, 4 * mib)


@pytest.mark.parametrize(
    ("events", "verdict", "retries"),
    [
        # Room for everything.
        ([alloc(1, 60 * MiB), free(1), alloc(2, 30 * MiB)], "fits", 0),
        # The freed 60 MiB stay cached; 80 more would reserve 140: the allocator releases its cache
        # (one retry) and then fits.
        ([alloc(1, 60 * MiB), free(1), alloc(2, 80 * MiB)], "fits_after_flush", 1),
        # A 10 MiB block is split from the cached 60 MiB segment, which it then pins; 56 MiB more do not
        # fit the 50 left in it, and the segment cannot be released: out of memory with 66 MiB of tensors.
        ([alloc(1, 60 * MiB), free(1), alloc(2, 10 * MiB), alloc(3, 56 * MiB)], "oom_fragmentation", 1),
        # The tensors alone exceed the card.
        ([alloc(1, 60 * MiB), alloc(2, 50 * MiB)], "oom_allocated", 1),
    ],
)
def test_a_trace_against_the_card_says_which_of_four_outcomes(events, verdict, retries):
    from harness.alloc import capacity_verdict

    unbounded = replay(events)
    bounded = replay(events, capacity_bytes=100 * MiB)
    judged = capacity_verdict(bounded, 100 * MiB, peak_allocated_bytes=unbounded.peak_allocated_bytes)
    assert (judged, bounded.num_alloc_retries) == (verdict, retries)
    assert bounded.peak_reserved_bytes <= 100 * MiB
