"""The results store: atomic one-file-per-run writes, a unified schema on read, corrupt files named."""

from __future__ import annotations

import multiprocessing
import time

import pandas as pd

from harness.store import compact, existing_ids, load_results, result_files, write_record


def record(i: int, **extra) -> dict:
    return {"config_id": f"id{i:04d}", "status": "ok", "peak_allocated_bytes": 1000 + i, **extra}


def test_round_trip_with_evolving_columns(tmp_path):
    # The first file lacks columns that later ones have: pandas' directory read would drop them.
    write_record(record(0), tmp_path)
    write_record(record(1, error="boom", per_rank_peak_bytes=[1, 2]), tmp_path)
    write_record(record(2, status="oom", mfu=float("nan")), tmp_path)
    frame, bad = load_results(tmp_path)
    assert bad == []
    assert len(frame) == 3 and {"error", "per_rank_peak_bytes", "mfu"} <= set(frame.columns)
    row1 = frame.set_index("config_id").loc["id0001"]
    assert row1["error"] == "boom" and list(row1["per_rank_peak_bytes"]) == [1, 2]
    assert pd.isna(frame.set_index("config_id").loc["id0000", "error"])
    assert existing_ids(tmp_path) == {"id0000", "id0001", "id0002"}


def test_corrupt_file_is_named_and_the_rest_load(tmp_path):
    for i in range(3):
        write_record(record(i), tmp_path)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    frame, bad = load_results(tmp_path)
    assert len(frame) == 3
    assert len(bad) == 1 and "broken.parquet" in bad[0]


def test_compact_merges_and_keeps_each_run_once(tmp_path):
    for i in range(5):
        write_record(record(i), tmp_path)
    path, n, bad = compact(tmp_path)
    assert (n, bad) == (5, []) and path.name == "dataset.parquet"
    assert len(result_files(tmp_path)) == 5  # per-run files stay (resume reads their names)
    frame, _ = load_results(tmp_path)
    assert len(frame) == 5
    # a committed study keeps only its dataset: its runs still count as done (resume runs none again)
    for f in result_files(tmp_path):
        f.unlink()
    assert existing_ids(tmp_path) == {f"id{i:04d}" for i in range(5)}


def _writer(directory, start, count):
    for i in range(start, start + count):
        write_record(record(i, payload="x" * 1000), directory)


def test_eight_concurrent_writers_and_a_reader_never_see_a_torn_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(tmp_path, k * 100, 100)) for k in range(8)]
    for w in writers:
        w.start()
    reads, errors = 0, 0
    while any(w.is_alive() for w in writers):
        frame, bad = load_results(tmp_path)
        errors += len(bad)
        reads += 1
        time.sleep(0.01)
    for w in writers:
        w.join()
    frame, bad = load_results(tmp_path)
    assert errors == 0 and bad == [] and reads > 0
    assert len(frame) == 800
    assert not list(tmp_path.glob(".*.tmp"))
