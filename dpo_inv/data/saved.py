"""Folders saved whole: the size of every file is recorded last, and checked before the folder is read, so
that a folder a killed or failed save left incomplete, or a file truncated since, is recognised. Arrow
tables (the data cache) are saved this way; so are checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import datasets

from dpo_inv.data.progress import quiet_datasets

TABLE_FILES = "dpo_inv_files.json"  # a saved table's files' sizes, its number of rows, what it was made of


def file_sizes(directory: Path) -> dict[str, int]:
    """Path relative to `directory` -> size in bytes, of every file below it."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}


def size_problem(directory: Path, sizes: dict[str, int]) -> str | None:
    """Which of the files recorded in `sizes` is missing or of another size now, or None."""
    for name, size in sizes.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when saved"
    return None


def save_atomically(table: datasets.Dataset, target: Path, made_of: dict | None = None) -> None:
    """Save to `target` through a temporary folder, the files' sizes (and `made_of`, see `saved_made_of`)
    written last; a concurrent run that saved it first wins."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_datasets():
        table.save_to_disk(str(tmp))
    record = {"num_rows": table.num_rows, "files": file_sizes(tmp), "made_of": made_of or {}}
    (tmp / TABLE_FILES).write_text(json.dumps(record))
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp)


def load_saved(target: Path) -> datasets.Dataset:
    """The table saved at `target` by `save_atomically`; a damaged one (a file missing, truncated or
    unreadable) raises a ValueError saying why."""
    try:
        saved = json.loads((target / TABLE_FILES).read_text())
        num_rows, sizes = saved["num_rows"], saved["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the cached table {target} is damaged: no complete {TABLE_FILES} ({err})") from None
    problem = size_problem(target, sizes)
    if problem is None:
        try:
            with quiet_datasets():
                table = datasets.load_from_disk(str(target))
        except Exception as err:  # whatever Arrow or datasets raise on a damaged file
            problem = f"unreadable: {type(err).__name__}: {err}"
        else:
            if table.num_rows == num_rows:
                return table
            problem = f"{table.num_rows} rows, {num_rows} when saved"
    raise ValueError(f"the cached table {target} is damaged: {problem}")


def saved_made_of(target: Path) -> dict:
    """What the table saved at `target` was made of, as given to `save_atomically`."""
    return json.loads((target / TABLE_FILES).read_text()).get("made_of", {})


def load_cached(target: Path) -> datasets.Dataset | None:
    """The table cached at `target`, or None when there is none to use: a damaged one (e.g. after a killed
    run or a full disk) is removed, with a note, to be built again."""
    if not target.is_dir():
        return None
    try:
        return load_saved(target)
    except ValueError as err:
        print(f"Note: {err}; building it again", flush=True)
    shutil.rmtree(target)
    return None
