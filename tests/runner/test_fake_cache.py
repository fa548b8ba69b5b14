"""The trace cache of ``run.mode=fake`` (``run.fake_cache``, harness/runner/fake/cache.py): what its key
counts, that a cached rank is never traced again, and that a rank taken for another card is judged
against that card's capacity."""

from __future__ import annotations

import json

import pytest
from conftest import fast_few, harness_cli, in_fresh_process, ok_trace, scripted_tracing, spec

from harness.runner.fake.ranks import rank_of, traced_ranks


def test_trace_key_ignores_the_card_but_not_the_layout_kernels_rank_or_code(monkeypatch):
    from harness.runner.fake import cache as fake_cache

    a100, h100 = spec("tiny", "a100_40gb"), spec("tiny", "h100_94gb")
    key = fake_cache.trace_key(a100, 0, "cuda")
    assert fake_cache.trace_key(h100, 0, "cuda") == key
    assert fake_cache.trace_key(a100, 0, "cpu") != key
    assert fake_cache.trace_key(a100, 1, "cuda") != key
    assert fake_cache.trace_key(spec("tiny", "a100_40gb", parallel_dp=2), 0, "cuda") != key
    monkeypatch.setattr(fake_cache, "code_hash", lambda: "another revision")
    assert fake_cache.trace_key(a100, 0, "cuda") != key


def _stage_trace(s, stage):
    from harness.runner.fake.ranks import rank_of
    from harness.runner.fake.trace import trace_rank

    r = trace_rank(s, rank_of(s, stage=stage), keep_trace=True)
    events = [(e["action"], e["size"], e.get("stream")) for e in r.pop("trace")]
    timings = ("trace_s", "trace_cpu_s", "host_rss_bytes")
    return {**{k: v for k, v in r.items() if k not in timings}, "events": events}


DP_INVARIANCE = {  # layout, and whether a rank's trace is the same at dp 2 and dp 4
    "pp_cp_replicate": ({"parallel_pp": 2, "parallel_cp": 2, "parallel_zero_stage": 0}, True),  # per stage
    "ddp": ({"parallel_zero_stage": 0}, True),  # DDP's buckets
    "zero1": ({"parallel_zero_stage": 1}, False),  # ZeroRedundancyOptimizer's partition is 1/dp
}


@pytest.mark.parametrize("name", fast_few(DP_INVARIANCE, ["ddp"]))
def test_without_zero_a_rank_traces_the_same_for_any_data_parallel_size(name):
    """What lets the trace cache key dp as "2 or more" without ZeRO: the last stage's rank traced with
    dp 2 and with dp 4 gives the same figures and the same events (action, size, stream), in order;
    with ZeRO-1 it does not, and the keys say so."""
    from harness.runner.fake.cache import trace_key

    layout, invariant = DP_INVARIANCE[name]
    from harness.runner.fake.ranks import rank_of

    two, four = (
        spec("tiny", "h100_94gb", parallel_dp=dp, train_seq_len=128, train_num_microbatches=4, **layout)
        for dp in (2, 4)
    )
    last = two.parallel.pp - 1
    a, b = (in_fresh_process(_stage_trace, s, last) for s in (two, four))
    assert a["peak_allocated_bytes"] > 0 and len(a["events"]) > 100
    assert (a == b) is invariant
    keys = (trace_key(s, rank_of(s, stage=last), "cuda") for s in (two, four))
    assert (len(set(keys)) == 1) is invariant


def test_trace_key_counts_data_parallel_replicas_only_as_one_or_more_without_zero():
    from harness.runner.fake.cache import mesh_coords, trace_key

    def key(dp, stage=1, **kw):
        s = spec("tiny", parallel_pp=2, parallel_dp=dp, parallel_zero_stage=0, **kw)
        return trace_key(s, rank_of(s, stage=stage), "cuda")

    assert key(2) == key(4) == key(8) != key(1)
    assert key(2) != key(2, stage=0)
    assert key(2, train_micro_batch_size=2) != key(2)
    s = spec("tiny", parallel_pp=2, parallel_dp=4, parallel_cp=2, parallel_tp=2)
    assert mesh_coords(s, rank_of(s, stage=1, dp=3, cp=1, tp=0)) == {"pp": 1, "dp": 3, "cp": 1, "tp": 0}


def test_ranks_in_the_trace_cache_are_not_traced_again(monkeypatch, tmp_path):
    """Ranks 0 and 8 traced (8 names ZeRO-1 rank 9), kept; the same layout again traces nothing and
    gives the same results in the same order. A failed rank is not kept: it is traced again."""
    from harness.runner.fake.cache import TraceCache
    from harness.runner.fake.pool import _trace_ranks

    cache, s = TraceCache(tmp_path), spec("tiny")
    results = {0: ok_trace(5), 8: ok_trace(7, extra=9), 9: ok_trace(6)}
    started, _ = scripted_tracing(monkeypatch, [[0, 8], [9]], results)
    first = _trace_ranks(s, [0, 8], deadline=0.0, kernels="cuda", jobs=2, cache=cache)
    assert started == [0, 8, 9] and len(list(tmp_path.glob("*.json"))) == 3
    started, _ = scripted_tracing(monkeypatch, [], results)
    again = _trace_ranks(s, [0, 8], deadline=0.0, kernels="cuda", jobs=2, cache=cache)
    assert started == [] and again == [{**r, "cached": True} for r in first]

    failed = {"error": "RuntimeError: boom"}
    started, _ = scripted_tracing(monkeypatch, [[4]], {4: failed})
    _trace_ranks(s, [4], deadline=0.0, kernels="cuda", jobs=1, cache=cache)
    started, _ = scripted_tracing(monkeypatch, [[4]], {4: failed})
    _trace_ranks(s, [4], deadline=0.0, kernels="cuda", jobs=1, cache=cache)
    assert started == [4]


def test_a_layout_traced_with_another_data_parallel_size_is_taken_with_this_layouts_ranks(
    monkeypatch, tmp_path
):
    """Without ZeRO, pp 2 traced on 4 GPUs (dp 2: ranks 0 and 2) serves pp 2 on 8 GPUs (dp 4: ranks 0
    and 4): nothing traced again, each result under the rank of the same stage in the new layout."""
    from harness.runner.fake.cache import TraceCache
    from harness.runner.fake.pool import _trace_ranks

    cache = TraceCache(tmp_path)
    small, large = (spec("tiny", parallel_pp=2, parallel_dp=dp, parallel_zero_stage=0) for dp in (2, 4))
    started, _ = scripted_tracing(monkeypatch, [[0, 2]], {0: ok_trace(5), 2: ok_trace(7)})
    _trace_ranks(small, traced_ranks(small), deadline=0.0, kernels="cuda", jobs=2, cache=cache)
    started, _ = scripted_tracing(monkeypatch, [], {})
    taken = _trace_ranks(large, traced_ranks(large), deadline=0.0, kernels="cuda", jobs=2, cache=cache)
    assert started == [] and traced_ranks(large) == [0, 4]
    assert [(r["rank"], r["peak_allocated_bytes"], r["cached"]) for r in taken] == [
        (0, 5, True),
        (4, 7, True),
    ]


@pytest.mark.slow  # (13 s; the cache's replay against each card is pinned by the tests above)
def test_harness_run_fake_takes_a_rank_traced_for_another_card_from_the_cache(tmp_path):
    """``run.fake_cache``: tiny dp 2 traced for an A100 is taken as it is for an H100 (nothing traced
    again: the record says which ranks came from the cache), the same figures, the H100's name."""
    args = [
        "run",
        "run.mode=fake",
        "model=tiny",
        "parallel.dp=2",
        f"run.fake_cache={tmp_path}",
        "format=json",
    ]
    a100 = harness_cli(*args, "device=a100_40gb")
    h100 = harness_cli(*args, "device=h100_94gb")
    assert a100.returncode == 0 and h100.returncode == 0, a100.stderr + h100.stderr
    first, second = json.loads(a100.stdout), json.loads(h100.stdout)
    assert (first["fake_cached_ranks"], second["fake_cached_ranks"]) == ([], [0])
    assert (first["device_name"], second["device_name"]) == ("a100_40gb", "h100_94gb")
    for key in ("peak_allocated_bytes", "per_rank_peak_bytes", "sim_peak_reserved_bytes", "mem_params_bytes"):
        assert first[key] == second[key], key
    assert first["config_id"] != second["config_id"]
    # the H100's capacity, as a trace made for it gives: the stored step replayed against it again
    fresh = harness_cli(*args[:-2], "format=json", "device=h100_94gb")
    assert fresh.returncode == 0, fresh.stderr
    capacity = ("sim_capacity_bytes", "sim_capacity_verdict", "sim_num_alloc_retries")
    assert first["sim_capacity_bytes"] < second["sim_capacity_bytes"]
    assert {k: second[k] for k in capacity} == {k: json.loads(fresh.stdout)[k] for k in capacity}


MiB = 2**20
# One block freed and a larger one made: the first segment cannot hold the second, so the replay opens
# two (140 MiB reserved, 80 MiB allocated at most). Freeing the cached one lets 80 MiB fit in 100.
STEP = [
    {"action": "alloc", "addr": 1, "size": 60 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 1, "size": 60 * MiB, "stream": 0},
    {"action": "alloc", "addr": 2, "size": 80 * MiB, "stream": 0},
    {"action": "free_completed", "addr": 2, "size": 80 * MiB, "stream": 0},
]


@pytest.mark.parametrize(
    ("capacity_mib", "verdict", "retries"),
    [(200, "fits", 0), (100, "fits_after_flush", 1), (50, "oom_allocated", 1)],
)
def test_a_rank_taken_for_another_card_is_replayed_against_that_cards_capacity(
    monkeypatch, tmp_path, capacity_mib, verdict, retries
):
    """A rank traced for one card (its step replayed against 1 GiB: fits) and taken from the cache for a
    card whose allocator may reserve ``capacity_mib``: its ``sim_capacity_*`` fields are that card's, as
    a fresh trace's replay gives them (``simulated``); every other field is the stored one."""
    from harness.runner.fake import trace as fake_trace
    from harness.runner.fake.cache import TraceCache
    from harness.runner.measure.trace import simulated

    s = spec("tiny", "h100_94gb")
    traced = {
        "peak_allocated_bytes": 80 * MiB,
        "mem_params_bytes": 7,
        **simulated(STEP, capacity_bytes=2**30),
    }
    assert traced["sim_capacity_verdict"] == "fits" and traced["sim_peak_reserved_bytes"] == 140 * MiB
    cache = TraceCache(tmp_path)
    cache.store(s, 0, "cuda", traced, STEP)
    monkeypatch.setattr(fake_trace, "card_capacity_bytes", lambda spec: capacity_mib * MiB)
    taken = cache.load(s, 0, "cuda")
    fresh = simulated(STEP, capacity_bytes=capacity_mib * MiB)
    assert (taken["sim_capacity_verdict"], taken["sim_num_alloc_retries"]) == (verdict, retries)
    assert taken == {**traced, **fresh}


def test_a_rank_stored_without_its_events_is_traced_again_for_another_card(monkeypatch, tmp_path):
    """Without the step's events another card's capacity cannot be judged: the entry is not taken."""
    from harness.runner.fake import trace as fake_trace
    from harness.runner.fake.cache import TraceCache
    from harness.runner.measure.trace import simulated

    s = spec("tiny", "h100_94gb")
    traced = {"peak_allocated_bytes": 80 * MiB, **simulated(STEP, capacity_bytes=2**30)}
    cache = TraceCache(tmp_path)
    cache.store(s, 0, "cuda", traced)
    monkeypatch.setattr(fake_trace, "card_capacity_bytes", lambda spec: 2**30)
    assert cache.load(s, 0, "cuda") == traced  # the same card: taken as stored
    monkeypatch.setattr(fake_trace, "card_capacity_bytes", lambda spec: 100 * MiB)
    assert cache.load(s, 0, "cuda") is None
