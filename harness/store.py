"""Run records to parquet (one file per run, written atomically) and back, with a unified schema.

A sweep writes ``<results_dir>/<config_id>.parquet`` for every point, whatever its status; resuming
skips the ids that already have a file. Reading goes through :func:`load_results`, never
``pandas.read_parquet(dir)``, which silently drops the columns that the first file lacks.
"""

from __future__ import annotations

import math
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def _cell(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def record_path(results_dir: str | Path, config_id: str) -> Path:
    return Path(results_dir) / f"{config_id}.parquet"


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write under a dot-prefixed temporary name in the same directory, then rename: a reader sees the
    whole file or nothing (the rename is atomic on one filesystem; dot files are ignored by readers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_record(record: dict[str, Any], results_dir: str | Path) -> Path:
    """One run's record as a one-row parquet file named by its config_id."""
    table = pa.Table.from_pylist([{k: _cell(v) for k, v in record.items()}])
    path = record_path(results_dir, record["config_id"])
    write_atomic(table, path)
    return path


def result_files(results_dir: str | Path) -> list[Path]:
    """Per-run files of a directory (not temporary files, not compacted datasets)."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*.parquet") if not p.name.startswith((".", "dataset")))


def existing_ids(results_dir: str | Path) -> set[str]:
    """config_ids that already have a result: per-run files by name (none is opened), and the
    ``config_id`` column of compacted datasets (a committed study resumes from its dataset alone)."""
    ids = {p.stem for p in result_files(results_dir)}
    root = Path(results_dir)
    for path in sorted(root.glob("dataset*.parquet")) if root.is_dir() else []:
        try:
            ids.update(pq.read_table(path, columns=["config_id"]).column("config_id").to_pylist())
        except Exception as exc:  # unreadable: its runs are not known to be done, so they run again
            print(f"harness: warning: cannot read config_id of {path} ({exc}); its points run again")
    return ids


def load_results(results_dir: str | Path, *, include_datasets: bool = True) -> tuple[pd.DataFrame, list[str]]:
    """Every run of a directory as one frame with the union of all columns (missing cells null), and the
    files that could not be read, each with the reason. Compacted ``dataset*.parquet`` files are read too
    (``include_datasets``); a run present both compacted and as its own file appears once."""
    root = Path(results_dir)
    files = result_files(root)
    if include_datasets and root.is_dir():
        files = sorted(root.glob("dataset*.parquet")) + files
    tables, bad = [], []
    for path in files:
        try:
            tables.append(pq.read_table(path))
        except Exception as exc:
            bad.append(f"{path}: {type(exc).__name__}: {exc}")
    if not tables:
        return pd.DataFrame(), bad
    frame = pa.concat_tables(tables, promote_options="permissive").to_pandas()
    if "config_id" in frame:
        frame = frame.drop_duplicates("config_id", keep="last").reset_index(drop=True)
    return frame, bad


def compact(results_dir: str | Path, *, name: str = "dataset") -> tuple[Path, int, list[str]]:
    """Merge every run of a directory into ``<results_dir>/<name>.parquet`` (atomically) and return the
    path, the number of runs and the unreadable files. Per-run files are kept (resume reads their names)."""
    frame, bad = load_results(results_dir)
    path = Path(results_dir) / f"{name}.parquet"
    write_atomic(pa.Table.from_pandas(frame, preserve_index=False), path)
    return path, len(frame), bad


def status_counts(frame: pd.DataFrame) -> Counter:
    return Counter(frame["status"]) if "status" in frame else Counter()
