"""Run records to parquet (one file per run, written atomically) and back, with a unified schema.

A sweep writes ``<results_dir>/<config_id>.parquet`` for every point, whatever its status; resuming
skips the ids that already have a file. Reading goes through :func:`load_results`, never
``pandas.read_parquet(dir)``, which silently drops the columns that the first file lacks.

The row files are the one source of truth (issue 12). ``dataset.parquet`` (``results compact``) is
derived from them: it lists, in its metadata, the row files it was compacted from. A row file always
wins over the dataset's copy of its run; a run the dataset lists whose row file has since been deleted
is gone (the dataset does not bring it back), unless none of the files it lists is present any more:
then the dataset stands alone for them (a committed study keeps its dataset and none of its row files).
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROW_FILES_KEY = b"harness.row_files"  # dataset metadata: the ids whose row files it was compacted from
READ_THREADS = 8  # reading 5,000 row files is per-file overhead (footer parsing): threads overlap it
REQUIRED = ("config_id", "status")  # what makes a parquet file a harness row


INT64_MAX = 2**63 - 1


def _cell(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        # an estimate of an absurd point (issue 12: it aborted a sweep with an OverflowError): a float
        # column reads it, and the permissive merge makes the column float where it meets int64
        return float(value)
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
        # On disk before the name points at it: after a crash the row is whole or absent, never a
        # named file with damaged data (issue 29).
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the filesystem lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def dataset_files(results_dir: str | Path) -> list[Path]:
    root = Path(results_dir)
    return sorted(root.glob("dataset*.parquet")) if root.is_dir() else []


ROW_OK, ROW_UNOPENABLE, ROW_DAMAGED = "ok", "unopenable", "damaged"


def row_state(path: Path) -> tuple[str, str | None]:
    """Whether a row file is its point's row — the one test of both "done" and "readable" (issue 29):

    - ``ok``: it opens, its ``config_id`` and ``status`` columns read, and its ``config_id`` is its name;
    - ``unopenable``: the file could not be opened at all (EACCES on another user's row, EMFILE, EIO,
      a stale NFS handle): nothing says it is damaged, so it is never set aside and its point counts as
      present — a machine's fault must not make a good row run again;
    - ``damaged``: it opened, and is not a row of its point (not parquet, truncated, data that does not
      decode, no ``config_id``/``status``, or another point's ``config_id``).
    The second value says why, for the last two."""
    try:
        with open(path, "rb") as f:
            f.read(4)
    except OSError as exc:
        return ROW_UNOPENABLE, f"{exc.strerror or exc}"
    try:
        table = pq.read_table(path, columns=["config_id", "status"])
        ids = table.column("config_id").to_pylist()
        table.column("status").to_pylist()
    except Exception as exc:  # whatever pyarrow says of the bytes it was given
        return ROW_DAMAGED, f"{type(exc).__name__}: {exc}"
    if ids != [path.stem]:
        return ROW_DAMAGED, f"its config_id is {ids[:1]}, not its file name"
    return ROW_OK, None


def set_aside(path: Path) -> Path:
    """Move a damaged row file out of the way (``<name>.corrupt``): its point has no row any more
    and runs again (issue 12: a truncated file counted as done, so its point never ran again)."""
    target = path.with_name(f"{path.name}.corrupt")
    os.replace(path, target)
    return target


def _row_files_of(dataset: Path) -> set[str] | None:
    """The ids a dataset was compacted from (None: a dataset written before it recorded them)."""
    meta = pq.read_schema(dataset).metadata or {}
    return set(json.loads(meta[ROW_FILES_KEY])) if ROW_FILES_KEY in meta else None


def deleted_since_compact(dataset: Path, row_ids: set[str]) -> set[str]:
    """The runs of ``dataset`` whose row files were deleted after it was compacted: those it lists that
    are missing now, provided any it lists is still here (none: the dataset stands alone)."""
    listed = _row_files_of(dataset)
    if not listed or not listed & row_ids:
        return set()
    return listed - row_ids


def existing_ids(results_dir: str | Path, *, set_aside_unreadable: bool = False) -> set[str]:
    """config_ids that already have a result: readable per-run files, and the ``config_id`` column of
    compacted datasets (a committed study resumes from its dataset alone) less the runs whose row files
    were deleted since. ``set_aside_unreadable`` (a sweep, before it launches): an unreadable row file
    is moved aside, named on stderr, and its point counts as not done."""
    files = result_files(results_dir)
    with ThreadPoolExecutor(READ_THREADS) as pool:
        states = list(pool.map(row_state, files))
    ids = set()
    for path, (state, why) in zip(files, states, strict=True):
        if state == ROW_OK:
            ids.add(path.stem)
        elif state == ROW_UNOPENABLE:
            ids.add(path.stem)
            print(f"harness: warning: cannot open {path} ({why}); its point counts as done", file=sys.stderr)
        elif set_aside_unreadable:
            target = set_aside(path)
            print(
                f"harness: damaged row file ({why}) moved aside to {target}; its point runs again",
                file=sys.stderr,
            )
    row_ids = {p.stem for p in files}
    for path in dataset_files(results_dir):
        try:
            ids.update(
                set(pq.read_table(path, columns=["config_id"]).column("config_id").to_pylist())
                - deleted_since_compact(path, row_ids)
            )
        except Exception as exc:  # unreadable: its runs are not known to be done, so they run again
            print(
                f"harness: warning: cannot read config_id of {path} ({exc}); its points run again",
                file=sys.stderr,
            )
    return ids


def _read(
    path: Path, columns: list[str] | None, schemas: dict[bytes, pa.Schema]
) -> tuple[pa.Table, pa.Schema]:
    """The file's table (only ``columns`` and the required ones, when given) and the schema of the whole
    file, which every column's clash is checked on: ``results status`` reads two of ~140 columns (issue
    12: reading all took 25 s over 5,000 row files) and still names a row whose other columns clash, as
    ``calibrate`` and ``report`` do (issue 29: it counted that row without naming it). The whole
    schema is built once per distinct serialized schema in the footers (``schemas``: the files of one
    sweep share a few), keyed by the footer's ``ARROW:schema`` entry, which the read parses anyway
    (building it for every file made status on 5,000 rows 7.8 s instead of 4.7)."""
    # ParquetFile.read skips the columns a file lacks.
    wanted = None if columns is None else list(dict.fromkeys([*REQUIRED, *columns]))
    parquet = pq.ParquetFile(path)
    table = parquet.read(columns=wanted, use_threads=False)
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise ValueError(f"not a harness row file (no {' or '.join(missing)} column); skipped")
    for name in REQUIRED:
        kind = table.schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
            raise ValueError(f"not a harness row file (column {name} is {kind}, not text); skipped")
    if columns is None:
        return table, table.schema
    key = (parquet.metadata.metadata or {}).get(b"ARROW:schema")
    if key is None:
        return table, parquet.schema_arrow
    if key not in schemas:
        schemas[key] = parquet.schema_arrow
    return table, schemas[key]


def _reference_types(schemas: list[pa.Schema]) -> dict[str, pa.DataType]:
    """Each column's type in most files (null columns have no say): the schema a clashing file is
    measured against, so that one foreign file cannot make every other file the odd one out."""
    votes: dict[str, Counter] = {}
    # Row files of one sweep share a few schema objects (_read's cache): counted by identity, since
    # hashing a ~140-field schema per file cost a second over 5,000 files.
    distinct = {id(schema): schema for schema in schemas}
    for key, n in Counter(id(schema) for schema in schemas).items():
        schema = distinct[key]
        for f in schema:
            if not pa.types.is_null(f.type):
                votes.setdefault(f.name, Counter())[f.type] += n
    return {name: counts.most_common(1)[0][0] for name, counts in votes.items()}


def _widen_integers(tables: list[pa.Table]) -> list[pa.Table]:
    """Integer columns that another table holds as floating point (a row file's int64 beside a
    dataset's float64, which its nulls made floating) cast to float64 here, unchecked. Arrow's
    permissive promotion refuses integers beyond 2**53 — paper-scale FLOP counts per step are ~1e16 —
    which a float64 holds to a few parts in 1e16."""
    floating = {f.name for t in tables for f in t.schema if pa.types.is_floating(f.type)}
    out = []
    for t in tables:
        for i, f in enumerate(t.schema):
            if f.name in floating and pa.types.is_integer(f.type):
                t = t.set_column(i, f.name, pc.cast(t.column(i), pa.float64(), safe=False))
        out.append(t)
    return out


def _clash(schema: pa.Schema, reference: dict[str, pa.DataType]) -> str | None:
    for f in schema:
        ref = reference.get(f.name)
        if ref is None or pa.types.is_null(f.type) or f.type == ref:
            continue
        try:
            pa.unify_schemas(
                [pa.schema([pa.field(f.name, ref)]), pa.schema([f])], promote_options="permissive"
            )
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            return f"column {f.name} is {f.type} here and {ref} in the other files; skipped"
    return None


def load_results(
    results_dir: str | Path, *, include_datasets: bool = True, columns: list[str] | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """Every run of a directory as one frame with the union of all columns (missing cells null), and the
    files that could not be read, each with the reason: unreadable, foreign (no ``config_id`` and
    ``status``) or type-clashing files are named and skipped, the rest load (issue 12). Compacted
    ``dataset*.parquet`` files are read too (``include_datasets``): a run present both compacted and as
    its own file appears once, as its row file says, and a run whose row file was deleted since the
    compaction does not come back. ``columns``: read only these (and ``config_id``, ``status``)."""
    root = Path(results_dir)
    rows = result_files(root)
    datasets = dataset_files(root) if include_datasets else []
    files = datasets + rows
    schemas: dict[bytes, pa.Schema] = {}  # (_read: shared by the threads; a lost race builds one twice)
    with ThreadPoolExecutor(READ_THREADS) as pool:
        results = list(pool.map(lambda p: _try(_read, p, columns, schemas), files))
    bad, read = [], []
    for path, (got, exc) in zip(files, results, strict=True):
        if exc is not None:
            bad.append(f"{path}: {type(exc).__name__}: {exc}")
        else:
            read.append((path, *got))
    reference = _reference_types([schema for _, _, schema in read])
    clashes: dict[int, str | None] = {}  # by identity, as in _reference_types
    tables = []
    row_ids = {p.stem for p in rows}
    for path, table, schema in read:
        if id(schema) not in clashes:
            clashes[id(schema)] = _clash(schema, reference)
        clash = clashes[id(schema)]
        if clash:
            bad.append(f"{path}: ArrowTypeError: {clash}")
            continue
        if path in datasets:
            gone = deleted_since_compact(path, row_ids)
            if gone:
                keep = pc.invert(pc.is_in(table.column("config_id"), pa.array(sorted(gone))))
                table = table.filter(keep)
        tables.append(table)
    if not tables:
        return pd.DataFrame(), bad
    frame = pa.concat_tables(_widen_integers(tables), promote_options="permissive").to_pandas()
    if "config_id" in frame:
        frame = frame.drop_duplicates("config_id", keep="last").reset_index(drop=True)
    return frame, bad


def _try(fn, *args):
    try:
        return fn(*args), None
    except Exception as exc:
        return None, exc


class CompactError(ValueError):
    """A compaction that would overwrite a dataset it could not read."""


def compact(results_dir: str | Path, *, name: str = "dataset") -> tuple[Path, int, list[str]]:
    """Merge every run of a directory into ``<results_dir>/<name>.parquet`` (atomically) and return the
    path, the number of runs and the unreadable files. Per-run files are kept (they stay the truth);
    the dataset lists the ones it was made from, so that deleting one later removes its run."""
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results_dir={results_dir} is not a directory")
    frame, bad = load_results(root)
    skipped = {line.split(": ", 1)[0] for line in bad}
    target = root / f"{name}.parquet"
    unread = [line for line in bad if line.split(": ", 1)[0] == str(target)]
    if unread:
        # Never overwrite what was not read: its runs would be lost (issue 29: a truncated committed
        # dataset became "0 runs", one with a column of an older type "2 runs").
        raise CompactError(
            f"{unread[0]}; not overwritten: move it aside (its runs are not in the row files) or fix it"
        )
    row_ids = sorted(p.stem for p in result_files(root) if str(p) not in skipped)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    meta = {**(table.schema.metadata or {}), ROW_FILES_KEY: json.dumps(row_ids).encode()}
    write_atomic(table.replace_schema_metadata(meta), target)
    return target, len(frame), bad


def status_counts(frame: pd.DataFrame) -> Counter:
    return Counter(frame["status"]) if "status" in frame else Counter()
