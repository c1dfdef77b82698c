"""Data files (JSON lines, JSON, CSV, Parquet) or data in memory (a list of dicts, a pandas DataFrame, a
`datasets.Dataset`) read into records, and the errors that name a bad record."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import datasets

from dpo_inv.data.progress import quiet_datasets
from dpo_inv.errors import DataError

if TYPE_CHECKING:
    import pandas

Data = Union[str, os.PathLike, Sequence[Mapping[str, Any]], "pandas.DataFrame", datasets.Dataset]
"""A data file's path, or its records in memory: a list of dicts, a pandas DataFrame, a `datasets.Dataset`."""

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
MAX_REPORTED_ERRORS = 20


@dataclass(frozen=True)
class BadRecord:
    """A record that cannot be used: where it is (`file:line` or `file record N`) and why, with the fix."""

    location: str
    reason: str
    record: dict | None = None  # as read, when it could be read

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass(frozen=True)
class Record:
    """One record of a data file and where it is; `error` says why it could not be read as an object."""

    location: str
    data: dict | None
    error: str = ""


def as_list(value: Any) -> list:
    """Lists arrive as lists (JSON, Parquet) or as strings such as "A,B", "A B" or "[0, 3]" (CSV)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            return json.loads(value)
        return [v for v in re.split(r"[,\s;]+", value) if v]
    return list(value)


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """`json.loads` hook: a JSON object, refused if a key appears twice (json would keep the last value)."""
    keys = [key for key, _ in pairs]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise _DuplicateKey(
            f"duplicate key {', '.join(map(repr, duplicated))} in one object; keep one value per field"
        )
    return dict(pairs)


def _not_utf8(data: bytes, err: UnicodeDecodeError, where: str) -> str:
    return f"not UTF-8 text (byte {data[err.start]:#04x} at {where} {err.start + 1}); save the file as UTF-8"


def _read_json_lines(path: Path) -> list[Record]:
    """One record per non-blank line; a line that is not a JSON object is a bad record, not a failure."""
    records = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            location = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                records.append(Record(location, None, _not_utf8(raw, err, "column")))
                continue
            if not line.strip():
                continue
            try:
                data = json.loads(line.rstrip("\r\n"), object_pairs_hook=_object)
            except _DuplicateKey as err:
                records.append(Record(location, None, str(err)))
                continue
            except json.JSONDecodeError as err:
                records.append(
                    Record(
                        location,
                        None,
                        f"malformed JSON ({err.msg.removesuffix(' at')} at column {err.colno}); fix the line",
                    )
                )
                continue
            if not isinstance(data, dict):
                reason = f"expected a JSON object, got {type(data).__name__}; write one object per line"
                records.append(Record(location, None, reason))
                continue
            records.append(Record(location, data))
    return records


def _read_json_list(path: Path) -> list[Record]:
    """A JSON file holding one list of objects."""
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_object)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: {_not_utf8(raw, err, 'offset')}") from None
    except _DuplicateKey as err:
        raise DataError(f"{path}: {err}") from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno}); fix the file"
        ) from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects, or JSON lines with one object per line")
    return [
        Record(f"{path} record {i}", r)
        if isinstance(r, dict)
        else Record(f"{path} record {i}", None, f"expected a JSON object, got {type(r).__name__}")
        for i, r in enumerate(data)
    ]


def _read_table(path: Path, builder: str) -> list[Record]:
    """CSV (with a header line) or Parquet, read with `datasets`."""
    if builder == "csv":
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8-sig")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{number}: {_not_utf8(raw, err, 'column')}") from None
                if number == 1:
                    header = next(csv.reader([line]))
                    duplicated = sorted({c for c in header if header.count(c) > 1})
                    if duplicated:
                        raise DataError(f"{path}:1: duplicate column {', '.join(map(repr, duplicated))}")
    try:
        with quiet_datasets():
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError) as err:
        raise DataError(f"{path}: cannot read {builder} data ({type(err).__name__}: {err})") from None
    if builder == "csv":  # the header is line 1
        return [Record(f"{path}:{i + 2}", row) for i, row in enumerate(table.to_list())]
    return [Record(f"{path} record {i}", row) for i, row in enumerate(table.to_list())]


def is_file(data: Data) -> bool:
    """Whether `data` names a file (else it holds the records)."""
    return isinstance(data, (str, os.PathLike))


def is_dataframe(data: Data) -> bool:
    """Whether `data` is a pandas DataFrame (pandas itself is not imported for the test)."""
    return type(data).__name__ == "DataFrame"


def _missing_as_none(value: Any) -> Any:
    """pandas marks a missing cell NaN (or NA, NaT): None, as in a CSV file read by `datasets`."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return None if type(value).__name__ in ("NAType", "NaTType") else value


def memory_records(data: Data, name: str) -> list[Record]:
    """The records of data in memory, each located as `NAME record I` (I: the DataFrame's index label, or
    the position)."""
    if is_dataframe(data):
        return [
            Record(f"{name} record {index}", {k: _missing_as_none(v) for k, v in row.items()})
            for index, row in zip(data.index, data.to_dict("records"), strict=True)
        ]
    if isinstance(data, datasets.Dataset):
        data = data.to_list()
    if isinstance(data, Mapping) or not isinstance(data, Sequence):
        raise DataError(
            f"{name}: expected a file path, a list of dicts, a pandas DataFrame or a datasets.Dataset, got "
            f"{type(data).__name__}"
        )
    return [
        Record(f"{name} record {i}", dict(row))
        if isinstance(row, Mapping)
        else Record(f"{name} record {i}", None, f"expected a dict, got {type(row).__name__}")
        for i, row in enumerate(data)
    ]


def data_name(data: Data, name: str) -> str:
    """How errors and reports name `data`: the file's path, or `name` for data in memory."""
    return os.fspath(data) if is_file(data) else name


def data_digest(data: Data, records: list[Record]) -> list:
    """What identifies `data` in a cache key: a file's path, size and modification time, or a hash of the
    records in memory."""
    if is_file(data) and not Path(data).is_dir():
        path = Path(data)
        return [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
    text = json.dumps([record.data for record in records], sort_keys=True, default=str)
    return [hashlib.sha256(text.encode()).hexdigest()]


STRUCTURE_FILES = (".pdb", ".ent", ".cif", ".mmcif")  # and each gzipped


def folder_records(path: Path) -> list[Record]:
    """A folder of structure files as records: one per file, its `pdb_file` (structure records)."""
    files = sorted(
        file for file in path.iterdir()
        if file.is_file() and file.name.lower().removesuffix(".gz").endswith(STRUCTURE_FILES)
    )  # fmt: skip
    if not files:
        raise DataError(
            f"{path}: a folder with no structure file ({', '.join(STRUCTURE_FILES)}, gzipped or not); give "
            "a folder of structures or a data file"
        )
    return [Record(str(file), {"pdb_file": str(file.resolve())}) for file in files]


def read_records(data: Data, name: str = "records") -> list[Record]:
    """The records of a JSON lines, JSON (one list), CSV or Parquet file, each with its location; of a
    folder of structure files (one structure record each); or of data in memory, named `name` in errors.

    A JSON line that cannot be read as an object is returned as a record with an `error`; a file that
    cannot be read at all raises `DataError`.
    """
    if not is_file(data):
        records = memory_records(data, name)
        if not records:
            raise DataError(f"{name}: empty dataset (no records); add records")
        return records
    path = Path(data)
    if path.is_dir():
        return folder_records(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported data format {path.suffix!r} (use {', '.join(FORMATS)})")
    if builder == "json":
        with open(path, "rb") as handle:
            is_list = handle.read(64).lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"["
        records = _read_json_list(path) if is_list else _read_json_lines(path)
    else:
        records = _read_table(path, builder)
    if not records:
        raise DataError(f"{path}: empty dataset (no records); add records or give another file")
    return records


def as_table(data: Data, rows: list[dict]) -> list[dict] | pandas.DataFrame:
    """Results for `data`: a DataFrame when `data` is one (with its index when there is one row per
    record), else the list of dicts."""
    if not is_dataframe(data):
        return rows
    import pandas

    return pandas.DataFrame(rows, index=data.index if len(rows) == len(data) else None)


def raise_bad_records(errors: list[str]) -> None:
    shown = errors[:MAX_REPORTED_ERRORS]
    more = f"\n... and {len(errors) - len(shown)} more bad records" if len(errors) > len(shown) else ""
    raise DataError("\n".join(shown) + more)


def records_folder(data: Data) -> Path:
    """The folder relative structure paths of `data` are relative to: a file's own, else the working
    directory."""
    return Path(data).resolve().parent if is_file(data) else Path.cwd()


def rebase_paths(rows: list[dict], source: Path, target: str | Path | None) -> list[dict]:
    """`rows` as they are written to a file in folder `target`, their structure paths (`pdb_file`,
    `structure`) having been relative to folder `source`: an absolute path stays as it is; a relative one
    becomes relative to `target` when that names the same file (through links too), else (and without a
    `target`) absolute."""
    out = []
    for row in rows:
        row = dict(row)
        for key in ("pdb_file", "structure"):
            path = row.get(key)
            if isinstance(path, str) and path and not os.path.isabs(path):
                full = os.path.normpath(source / path)
                relative = os.path.relpath(full, Path(target).absolute()) if target is not None else full
                same = target is not None and (Path(target) / relative).resolve() == Path(full).resolve()
                row[key] = relative if same else full
        out.append(row)
    return out


def write_text(path: str | Path, text: str) -> None:
    """Write through a temporary file: a killed write leaves the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """One JSON object per line, written atomically."""
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def write_json(path: str | Path, value: object) -> None:
    """One indented JSON document, written atomically."""
    write_text(path, json.dumps(value, indent=2) + "\n")
