"""The results store: atomic one-file-per-run writes, a unified schema on read, corrupt files named."""

from __future__ import annotations

import multiprocessing
import time

import pandas as pd
from conftest import harness_cli

from harness.sweep.store import compact, existing_ids, load_results, result_files, write_record


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


# ------------------------------------------------------------- issue 12: foreign files, truncation, truth


def test_truncated_row_file_is_set_aside_and_its_point_runs_again(tmp_path, capsys):
    for i in range(3):
        write_record(record(i), tmp_path)
    path = tmp_path / "id0001.parquet"
    path.write_bytes(path.read_bytes()[:100])  # a writer killed mid-copy, a full disk
    # Status and the other readers name it and skip it, and move nothing:
    frame, bad = load_results(tmp_path)
    assert len(frame) == 2 and len(bad) == 1 and "id0001.parquet" in bad[0]
    assert existing_ids(tmp_path) == {"id0000", "id0002"}
    assert path.exists()
    # A sweep (set_aside_unreadable) moves it aside, says so, and the point is not done.
    assert existing_ids(tmp_path, set_aside_unreadable=True) == {"id0000", "id0002"}
    assert not path.exists() and (tmp_path / "id0001.parquet.corrupt").exists()
    assert "id0001.parquet.corrupt" in capsys.readouterr().err
    assert load_results(tmp_path)[1] == []


def test_foreign_and_type_clashing_files_are_named_and_skipped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(3):
        write_record(record(i), tmp_path)
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "notes.parquet")  # someone else's file
    write_record(record(7, peak_allocated_bytes="a lot"), tmp_path)  # a row whose peak is text
    pq.write_table(pa.table({"config_id": ["id0008"], "status": [3]}), tmp_path / "id0008.parquet")
    frame, bad = load_results(tmp_path)
    assert sorted(frame["config_id"]) == ["id0000", "id0001", "id0002"]
    assert frame["peak_allocated_bytes"].tolist() == [1000, 1001, 1002]
    named = {line.split(": ", 1)[0].rsplit("/", 1)[1]: line for line in bad}
    assert set(named) == {"notes.parquet", "id0007.parquet", "id0008.parquet"}
    assert "not a harness row file (no config_id or status column)" in named["notes.parquet"]
    assert (
        "column peak_allocated_bytes is string here and int64 in the other files" in named["id0007.parquet"]
    )
    assert "column status is int64, not text" in named["id0008.parquet"]
    # compact skips them the same way; the two-column read of `results status` checks every column's
    # type in the footers, so the row whose peak is text is named there too (issue 29: it was counted)
    assert compact(tmp_path)[1:] == (3, bad)
    frame, bad_status = load_results(tmp_path, columns=["status"])
    assert sorted(frame["config_id"]) == ["id0000", "id0001", "id0002"] and sorted(bad_status) == sorted(bad)


def test_row_files_are_the_truth_and_the_dataset_is_derived(tmp_path):
    for i in range(3):
        write_record(record(i), tmp_path)
    compact(tmp_path)
    # A rerun replaces a row file (sweep.retry): the row file wins over the dataset's copy.
    write_record(record(0, status="timeout"), tmp_path)
    # A deleted row file stays deleted: the dataset does not bring it back, and compacting again
    # does not resurrect it either.
    (tmp_path / "id0002.parquet").unlink()
    for _ in range(2):
        frame, bad = load_results(tmp_path)
        assert bad == [] and dict(zip(frame["config_id"], frame["status"], strict=True)) == {
            "id0000": "timeout",
            "id0001": "ok",
        }
        assert existing_ids(tmp_path) == {"id0000", "id0001"}
        compact(tmp_path)
    # A new run swept into a directory whose dataset stands alone (no listed row file left) keeps
    # every compacted run.
    for f in result_files(tmp_path):
        f.unlink()
    write_record(record(5), tmp_path)
    assert existing_ids(tmp_path) == {"id0000", "id0001", "id0005"}


def test_paper_scale_integers_beside_a_compacted_floating_column_load(tmp_path):
    """A FLOP count of a 70B step (~1.4e16, beyond 2**53) in a row file, the same column floating in
    the compacted dataset (an invalid row's null made it so): Arrow's permissive concatenation refused
    the integer ("not in range"), so calibrate and report failed on the paper fake studies."""
    big = 13_769_733_870_452_736
    write_record(record(0, status="invalid", model_flops_per_step=None), tmp_path)
    write_record(record(1, model_flops_per_step=big), tmp_path)
    compact(tmp_path)
    write_record(record(2, model_flops_per_step=big + 2**10), tmp_path)  # a row file after the compaction
    frame, bad = load_results(tmp_path)
    assert bad == [] and len(frame) == 3
    flops = frame.set_index("config_id")["model_flops_per_step"]
    assert flops["id0001"] == float(big) and flops["id0002"] == float(big + 2**10)
    assert pd.isna(flops["id0000"])


# --- issue 29: nothing lost, nothing run twice ------------------------------------------------------


def _damage_data(path) -> None:
    """Flip bytes of the first data page, the footer left intact (its metadata still reads)."""
    raw = bytearray(path.read_bytes())
    for i in range(4, 60):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_row_with_damaged_data_or_another_points_id_is_not_done(tmp_path, capsys):
    import pyarrow.parquet as pq

    from harness.sweep.store import record_path

    write_record(record(0), tmp_path)
    damaged = write_record(record(1), tmp_path)
    _damage_data(damaged)
    assert pq.read_metadata(damaged).num_rows == 1  # (what the sweep used to read: "done")
    write_record(record(2), tmp_path)
    record_path(tmp_path, "id0002").rename(record_path(tmp_path, "id0003"))  # id0002's row, named id0003
    assert existing_ids(tmp_path, set_aside_unreadable=True) == {"id0000"}
    assert not damaged.exists() and (tmp_path / "id0001.parquet.corrupt").exists()
    assert (tmp_path / "id0003.parquet.corrupt").exists()
    err = capsys.readouterr().err
    assert "not its file name" in err and "Couldn't deserialize" in err


def _ids_as_nobody(root: str, queue) -> None:
    import os

    os.setgid(65534)
    os.setuid(65534)
    queue.put(sorted(existing_ids(root, set_aside_unreadable=True)))


def test_a_row_that_cannot_be_opened_is_never_set_aside_nor_run_again(capsys):
    # Another user's row in a shared results_dir (EACCES): before issue 29 it was renamed .corrupt and
    # its point measured again. Run as an unprivileged user where the tests run as root.
    import os
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    try:
        root.chmod(0o777)
        write_record(record(0), root)
        theirs = write_record(record(1), root)
        theirs.chmod(0o000)
        if os.geteuid() == 0:
            ctx = multiprocessing.get_context("fork")
            queue = ctx.Queue()
            child = ctx.Process(target=_ids_as_nobody, args=(str(root), queue))
            child.start()
            ids = queue.get(timeout=60)
            child.join()
        else:
            ids = sorted(existing_ids(root, set_aside_unreadable=True))
            assert "cannot open" in capsys.readouterr().err
        assert ids == ["id0000", "id0001"]
        assert theirs.exists() and not (root / "id0001.parquet.corrupt").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_compact_never_overwrites_a_dataset_it_could_not_read(tmp_path):
    import pyarrow as pa
    import pytest

    from harness.sweep.store import CompactError

    # A truncated committed dataset and no row files: it must not become "0 runs".
    write_record(record(0), tmp_path)
    path, _, _ = compact(tmp_path)
    (tmp_path / "id0000.parquet").unlink()
    truncated = path.read_bytes()[:100]
    path.write_bytes(truncated)
    with pytest.raises(CompactError, match="not overwritten"):
        compact(tmp_path)
    assert path.read_bytes() == truncated
    # A dataset with a column of an older type beside new rows: refused too, not "2 runs".
    other = tmp_path / "older"
    for i in range(8):
        write_record(record(i, oom_kind=i), other)
    compact(other)
    for p in result_files(other):
        p.unlink()
    for i in (8, 9):
        write_record(record(i, oom_kind="cublas"), other)
    before = (other / "dataset.parquet").read_bytes()
    with pytest.raises(CompactError):
        compact(other)
    assert (other / "dataset.parquet").read_bytes() == before
    assert pa.parquet.read_table(other / "dataset.parquet").num_rows == 8


def test_results_status_names_a_row_whose_other_columns_clash(tmp_path):
    """issue 29 item 9: status read two columns and counted a row that calibrate and report skip for a
    clash in another column, without naming it; it now checks every column's type in the footers."""
    write_record({"config_id": "a", "status": "ok", "peak_allocated_bytes": 100}, tmp_path)
    write_record({"config_id": "b", "status": "ok", "peak_allocated_bytes": "100"}, tmp_path)
    write_record({"config_id": "c", "status": "oom", "peak_allocated_bytes": 300}, tmp_path)
    done = harness_cli("results", "status", f"results_dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path}: 2 runs: ok 1, oom 1")
    assert done.stderr.strip() == (
        f"unreadable: {tmp_path}/b.parquet: ArrowTypeError: column peak_allocated_bytes is string here "
        "and int64 in the other files; skipped"
    )
