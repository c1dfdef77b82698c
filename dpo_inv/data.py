"""Preference pairs: loading, validation, cached structure features, batching."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from dpo_inv.progress import progress, quiet_datasets
from dpo_inv.structure import ALPHABET, StructureError, featurize, parse_structure, tokenize

PARSE_CHUNK = 512  # structures parsed between two progress updates
FEATURES_VERSION = "1"  # bump when the stored structure features change
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ALIASES = {"structure": "pdb_file", "chosen": "preferred_seq", "rejected": "unpreferred_seq"}
MAX_REPORTED_ERRORS = 20


class DataError(ValueError):
    """Bad input data; each line of the message names the file, the record, what is wrong and the fix."""


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


@dataclass(frozen=True)
class PairDataset:
    """Validated pairs plus the features of every distinct (structure, chains) they use.

    `skipped` lists the bad records left out (with `on_bad_record="skip"`); `files` are the cache
    directories of the two tables, from which other processes load the same data (`load_saved_pairs`).
    """

    pairs: datasets.Dataset
    structures: datasets.Dataset
    source: str
    skipped: tuple[BadRecord, ...] = ()
    files: tuple[str, str] | None = None


def _as_list(value: Any) -> list:
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
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError) as err:
        raise DataError(f"{path}: cannot read {builder} data ({type(err).__name__}: {err})") from None
    if builder == "csv":  # the header is line 1
        return [Record(f"{path}:{i + 2}", row) for i, row in enumerate(table.to_list())]
    return [Record(f"{path} record {i}", row) for i, row in enumerate(table.to_list())]


def load_records(path: str | Path) -> list[Record]:
    """The records of a JSON lines, JSON (one list), CSV or Parquet file, each with its location.

    A JSON line that cannot be read as an object is returned as a record with an `error`; a file that
    cannot be read at all raises `DataError`.
    """
    path = Path(path)
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


def _structure_key(
    record: dict, root: Path, allowed: Sequence[Path]
) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(resolved structure path, designed chains, fixed chains) of a normalised record; a ValueError says
    why the record names no usable structure file."""
    pdb_file = record.get("pdb_file")
    if not isinstance(pdb_file, str) or not pdb_file:
        raise ValueError("missing required field pdb_file (alias structure): the structure file's path")
    path = (Path(pdb_file) if Path(pdb_file).is_absolute() else root / pdb_file).resolve()
    if allowed and not any(path.is_relative_to(folder) for folder in allowed):
        raise ValueError(
            f"structure file {path} is outside structure_root ({', '.join(map(str, allowed))}); move it "
            "there or add its folder to structure_root"
        )
    if not path.is_file():
        raise ValueError(
            f"structure file not found: {path} (a relative path is relative to the data file's folder)"
        )
    if not os.access(path, os.R_OK):
        raise ValueError(f"structure file not readable: {path} (permission denied)")
    if record.get("chain_id") not in (None, ""):
        design = [str(record["chain_id"])]
    else:
        design = [str(c) for c in _as_list(record.get("design_chains"))]
    fixed = [str(c) for c in _as_list(record.get("fixed_chains"))]
    return str(path), tuple(design), tuple(fixed)


def _normalise(record: dict) -> dict:
    out = dict(record)
    for alias, name in ALIASES.items():
        if out.get(name) is None and out.get(alias) is not None:
            out[name] = out[alias]
    return out


def _featurize_structure(row: dict) -> dict:
    """`datasets.map` function: parse and featurize one (structure, chains); errors are stored, not raised."""
    out = {"error": "", "length": 0, "num_designed": 0}
    empty = {
        "X": np.zeros(0, np.float32),
        "mask": np.zeros(0, np.float32),
        "residue_idx": np.zeros(0, np.int32),
        "chain_encoding": np.zeros(0, np.int32),
        "design_mask": np.zeros(0, np.float32),
        "native": np.zeros(0, np.int8),
    }
    try:
        chains = parse_structure(row["path"])
        design = row["design_chains"] or [next(iter(chains))]
        features = featurize(chains, design, row["fixed_chains"], row["path"])
    except StructureError as err:
        return {**out, **empty, "error": str(err)}
    return {
        **out,
        "X": features.X.reshape(-1),
        "mask": features.mask,
        "residue_idx": features.residue_idx.astype(np.int32),
        "chain_encoding": features.chain_encoding.astype(np.int32),
        "design_mask": features.design_mask,
        "native": features.native.astype(np.int8),
        "length": len(features.mask),
        "num_designed": int(features.design_mask.sum()),
        "design_chains": design,
    }


STRUCTURE_FEATURES = datasets.Features(
    {
        "path": datasets.Value("string"),
        "design_chains": datasets.Sequence(datasets.Value("string")),
        "fixed_chains": datasets.Sequence(datasets.Value("string")),
        "error": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "num_designed": datasets.Value("int32"),
        "X": datasets.Sequence(datasets.Value("float32")),
        "mask": datasets.Sequence(datasets.Value("float32")),
        "residue_idx": datasets.Sequence(datasets.Value("int32")),
        "chain_encoding": datasets.Sequence(datasets.Value("int32")),
        "design_mask": datasets.Sequence(datasets.Value("float32")),
        "native": datasets.Sequence(datasets.Value("int8")),
    }
)


def _fingerprint(keys: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> str:
    """Hash of the structure keys and each file's size and modification time: a changed file invalidates."""
    digest = hashlib.sha256(FEATURES_VERSION.encode())
    for path, design, fixed in keys:
        stat = Path(path).stat()
        digest.update(json.dumps([path, design, fixed, stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()[:20]


def default_cache_dir() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "dpo_inv"


def _save_atomically(table: datasets.Dataset, target: Path) -> None:
    """Save to `target` through a temporary folder; a concurrent run that saved it first wins."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    table.save_to_disk(str(tmp))
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp)


def build_structures(
    keys: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]],
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, Path, bool]:
    """Features of each structure key, parsed once and cached as Arrow; returns (table, its folder,
    loaded_from_cache). A structure that cannot be used is kept as a row with its `error`."""
    cache_root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_root / f"structures-{_fingerprint(keys)}"
    if target.is_dir():
        with quiet_datasets():
            return datasets.load_from_disk(str(target)), target, True
    keys_table = {
        "path": [k[0] for k in keys],
        "design_chains": [list(k[1]) for k in keys],
        "fixed_chains": [list(k[2]) for k in keys],
    }  # typed: a column of empty lists would otherwise be read as nulls, which no feature can follow
    table = datasets.Dataset.from_dict(
        keys_table, features=datasets.Features({name: STRUCTURE_FEATURES[name] for name in keys_table})
    )
    parts = []
    with quiet_datasets(), progress(total=len(keys), desc="Parsing structures", unit="structure",
                                    disable=len(keys) <= PARSE_CHUNK) as bar:  # fmt: skip
        for start in range(0, len(keys), PARSE_CHUNK):
            chunk = table.select(range(start, min(start + PARSE_CHUNK, len(keys))))
            parts.append(
                chunk.map(
                    _featurize_structure,
                    features=STRUCTURE_FEATURES,
                    num_proc=num_proc if num_proc and num_proc > 1 and len(chunk) > 1 else None,
                    keep_in_memory=True,
                )
            )
            bar.update(len(chunk))
        _save_atomically(datasets.concatenate_datasets(parts), target)
        return datasets.load_from_disk(str(target)), target, False


def _mutable_mask(record: dict, num_designed: int) -> np.ndarray:
    positions = _as_list(record.get("mutable_positions"))
    ranges = _as_list(record.get("mutable_ranges"))
    if positions and ranges:
        raise ValueError("give mutable_positions or mutable_ranges, not both")
    if not positions and not ranges:
        return np.ones(num_designed, dtype=np.int8)
    if ranges:
        if any(not isinstance(r, (list, tuple)) or len(r) != 2 for r in ranges):
            raise ValueError(f"mutable_ranges must be inclusive [start, end] pairs, got {ranges}")
        positions = [p for start, end in ranges for p in range(int(start), int(end) + 1)]
    mask = np.zeros(num_designed, dtype=np.int8)
    for p in positions:
        if not 0 <= int(p) < num_designed:
            raise ValueError(f"mutable position {p} outside the designed sequence (0..{num_designed - 1})")
        mask[int(p)] = 1
    return mask


def _check_sequence(name: str, seq: Any, expected: int, pdb: str, chains: tuple[str, ...]) -> np.ndarray:
    if not isinstance(seq, str) or not seq:
        alias = {v: k for k, v in ALIASES.items()}.get(name)
        raise ValueError(f"missing required field {name}" + (f" (alias {alias})" if alias else ""))
    bad = sorted(set(seq) - set(ALPHABET))
    if bad:
        raise ValueError(
            f"{name} has characters outside the 20 amino acids + X: {''.join(bad)!r}; write upper-case "
            "one-letter codes"
        )
    if len(seq) != expected:
        raise ValueError(
            f"{name} has length {len(seq)} but designed chains {list(chains)} of {pdb} have {expected} "
            "residues; give one letter per residue of the designed chains, in chain order"
        )
    return tokenize(seq)


PAIR_FIELDS = ("preferred_seq", "unpreferred_seq")
SEQUENCE_FIELDS = ("sequence", "wildtype_seq")  # a sequences file; wildtype_seq is optional
ON_BAD_RECORD = ("fail", "skip")
PAIR_FEATURES = datasets.Features(
    {
        "structure_id": datasets.Value("int32"),
        "chosen": datasets.Sequence(datasets.Value("int8")),
        "rejected": datasets.Sequence(datasets.Value("int8")),
        "mutable": datasets.Sequence(datasets.Value("int8")),
        "weight": datasets.Value("float32"),
    }
)


def load_pairs(
    path: str | Path,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    fields: tuple[str, str] = PAIR_FIELDS,
    structure_roots: Sequence[str | Path] = (),
    on_bad_record: str = "fail",
) -> PairDataset:
    """Load and validate a preference file. Every record is checked; with `on_bad_record="fail"` all bad
    records are reported together in one `DataError`, with `"skip"` they are left out and listed in
    `skipped`. With `structure_roots`, structure files must lie in one of these folders.

    `fields` name the two sequences of a record (stored as `chosen` and `rejected`); with
    `SEQUENCE_FIELDS` a sequences file loads the same way, a missing `wildtype_seq` meaning the sequence.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    path = Path(path)
    records = load_records(path)
    root = path.resolve().parent
    allowed = [Path(folder).resolve() for folder in structure_roots]
    bad: dict[int, BadRecord] = {}
    keys: dict[tuple[str, tuple[str, ...], tuple[str, ...]], int] = {}
    usable: list[tuple[int, dict, int]] = []  # (record number, normalised record, structure id)
    for number, record in enumerate(records):
        if record.data is None:
            bad[number] = BadRecord(record.location, record.error)
            continue
        data = _normalise(record.data)
        try:
            key = _structure_key(data, root, allowed)
        except ValueError as err:
            bad[number] = BadRecord(record.location, str(err), record.data)
            continue
        usable.append((number, data, keys.setdefault(key, len(keys))))

    structures, structures_dir = None, None
    if keys:
        structures, structures_dir, _ = build_structures(list(keys), cache_dir=cache_dir, num_proc=num_proc)
        structure_errors = list(structures["error"])  # plain lists: one column read, not one per record
        num_designed = list(structures["num_designed"])
        design_chains = list(structures["design_chains"])
    columns: dict[str, list] = {name: [] for name in PAIR_FEATURES}
    for number, data, sid in usable:
        location = records[number].location
        if structure_errors[sid]:
            bad[number] = BadRecord(location, structure_errors[sid], records[number].data)
            continue
        pdb, chains = data["pdb_file"], tuple(design_chains[sid])
        try:
            first, second = fields
            if fields == SEQUENCE_FIELDS and data.get(second) is None:
                second = first
            chosen = _check_sequence(first, data.get(first), num_designed[sid], pdb, chains)
            rejected = _check_sequence(second, data.get(second), num_designed[sid], pdb, chains)
            mutable = _mutable_mask(data, num_designed[sid])
            weight = float(data["weight"]) if data.get("weight") is not None else 1.0
            if not np.isfinite(weight) or weight < 0:
                raise ValueError(f"weight must be a finite number >= 0, got {data['weight']!r}")
        except (ValueError, TypeError) as err:
            bad[number] = BadRecord(location, str(err), records[number].data)
            continue
        columns["structure_id"].append(sid)
        columns["chosen"].append(chosen)
        columns["rejected"].append(rejected)
        columns["mutable"].append(mutable)
        columns["weight"].append(weight)
    skipped = tuple(bad[number] for number in sorted(bad))
    if skipped and on_bad_record == "fail":
        _raise([str(b) for b in skipped])
    if not columns["structure_id"]:
        _raise([*map(str, skipped), f"{path}: no usable record among {len(records)}; fix the records above"])

    # saved beside the structures, under a name that changes with the data file and the options
    digest = hashlib.sha256(
        json.dumps(
            [FEATURES_VERSION, structures_dir.name, str(path.resolve()), path.stat().st_size,
             path.stat().st_mtime_ns, fields, [str(a) for a in allowed], on_bad_record]
        ).encode()
    ).hexdigest()[:20]  # fmt: skip
    pairs_dir = structures_dir.parent / f"pairs-{digest}"
    with quiet_datasets():
        if not pairs_dir.is_dir():
            _save_atomically(datasets.Dataset.from_dict(columns, features=PAIR_FEATURES), pairs_dir)
        pairs = datasets.load_from_disk(str(pairs_dir))
    return PairDataset(
        pairs=pairs,
        structures=structures,
        source=str(path),
        skipped=skipped,
        files=(str(pairs_dir), str(structures_dir)),
    )


def load_saved_pairs(files: tuple[str, str], source: str) -> PairDataset:
    """The pairs another process has loaded and validated (its `PairDataset.files`)."""
    pairs_dir, structures_dir = files
    with quiet_datasets():
        pairs, structures = datasets.load_from_disk(pairs_dir), datasets.load_from_disk(structures_dir)
    return PairDataset(pairs=pairs, structures=structures, source=source, files=files)


def _raise(errors: list[str]) -> None:
    shown = errors[:MAX_REPORTED_ERRORS]
    more = f"\n... and {len(errors) - len(shown)} more bad records" if len(errors) > len(shown) else ""
    raise DataError("\n".join(shown) + more)


class PreferenceDataset(TorchDataset):
    """Map-style dataset of examples: one pair joined with its structure's features."""

    def __init__(self, data: PairDataset) -> None:
        self.pairs = data.pairs.with_format("numpy")
        self.structures = data.structures.with_format("numpy")
        self.lengths = np.asarray(data.structures["length"])[np.asarray(data.pairs["structure_id"])]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.pairs[int(index)]
        structure = self.structures[int(pair["structure_id"])]
        return {"index": int(index), **pair, **{k: structure[k] for k in BATCH_STRUCTURE_KEYS}}


BATCH_STRUCTURE_KEYS = ("X", "mask", "residue_idx", "chain_encoding", "design_mask", "native")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # with precompute_ref_log_probs


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad a list of examples into a batch. Designed residues come first in each structure.

    `loss_mask` marks designed, observed, mutable positions (where log p is summed); `decode_mask` marks
    the positions decoded after all others (designed and mutable), as ProteinMPNN orders fixed positions.
    """
    B, L = len(examples), max(len(e["mask"]) for e in examples)
    batch = {
        "X": torch.zeros(B, L, 4, 3),
        "mask": torch.zeros(B, L),
        "residue_idx": torch.full((B, L), -100, dtype=torch.long),
        "chain_encoding": torch.zeros(B, L, dtype=torch.long),
        "decode_mask": torch.zeros(B, L),
        "loss_mask": torch.zeros(B, L),
        "native": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "chosen": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "rejected": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "weight": torch.tensor([float(e["weight"]) for e in examples]),
        "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        "length": torch.tensor([len(e["mask"]) for e in examples], dtype=torch.long),
    }
    for name in REFERENCE_COLUMNS:
        if name in examples[0]:
            batch[name] = torch.tensor([float(e[name]) for e in examples])
    for i, e in enumerate(examples):
        n, d = len(e["mask"]), len(e["chosen"])
        mask = torch.from_numpy(np.asarray(e["mask"], dtype=np.float32))
        native = torch.from_numpy(np.asarray(e["native"], dtype=np.int64))
        mutable = torch.from_numpy(np.asarray(e["mutable"], dtype=np.float32))
        batch["X"][i, :n] = torch.from_numpy(np.asarray(e["X"], dtype=np.float32).reshape(n, 4, 3))
        batch["mask"][i, :n] = mask
        batch["residue_idx"][i, :n] = torch.from_numpy(np.asarray(e["residue_idx"], dtype=np.int64))
        batch["chain_encoding"][i, :n] = torch.from_numpy(np.asarray(e["chain_encoding"], dtype=np.int64))
        batch["decode_mask"][i, :d] = mutable
        batch["loss_mask"][i, :d] = mutable * mask[:d]
        batch["native"][i, :n] = native
        for name in ("chosen", "rejected"):
            batch[name][i, :n] = native
            batch[name][i, :d] = torch.from_numpy(np.asarray(e[name], dtype=np.int64))
    return batch


class LengthGroupedSampler(Sampler[int]):
    """Shuffled indices where consecutive `batch_size` chunks have similar lengths (less padding).

    Reproducible per (seed, epoch): call `set_epoch` before each epoch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))
