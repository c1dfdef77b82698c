"""Preference pairs: loading, validation, cached structure features, batching."""

from __future__ import annotations

import hashlib
import json
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

from dpo_inv.structure import ALPHABET, StructureError, featurize, parse_structure, tokenize

FEATURES_VERSION = "1"  # bump when the stored structure features change
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ALIASES = {"structure": "pdb_file", "chosen": "preferred_seq", "rejected": "unpreferred_seq"}
SEQUENCE_RE = re.compile(f"^[{ALPHABET}]+$")
MAX_REPORTED_ERRORS = 20


class DataError(ValueError):
    """Bad input data; the message names the file, the record and what is wrong."""


@dataclass(frozen=True)
class PairDataset:
    """Validated pairs plus the features of every distinct (structure, chains) they use."""

    pairs: datasets.Dataset
    structures: datasets.Dataset
    source: str


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


def _record_label(source: Path, index: int, line_numbers: list[int] | None) -> str:
    if line_numbers is not None:
        return f"{source}:{line_numbers[index]}"
    return f"{source} record {index}"


def _json_line_numbers(path: Path) -> list[int]:
    """Line number of every record in a JSON-lines file, failing on the first malformed line."""
    numbers = []
    with open(path, encoding="utf-8", errors="strict") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{number}: malformed JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            numbers.append(number)
    return numbers


def _check_json_list(path: Path) -> None:
    """A JSON file holding one list must be a non-empty list of objects."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not records:
        raise DataError(f"{path}: empty dataset (no records)")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path} record {index}: expected a JSON object, got {type(record).__name__}")


def _is_json_lines(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    with open(path, "rb") as handle:
        return handle.read(64).lstrip()[:1] != b"["


def load_records(path: str | Path, cache_dir: str | None = None) -> tuple[datasets.Dataset, list[int] | None]:
    """Load JSON (a list), JSON lines, CSV or Parquet with `datasets`; returns records and line numbers."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported data format {path.suffix!r} (use {', '.join(FORMATS)})")
    line_numbers = None
    try:
        if builder == "json" and _is_json_lines(path):
            line_numbers = _json_line_numbers(path)
        elif builder == "json":
            _check_json_list(path)
        if line_numbers == []:
            raise DataError(f"{path}: empty dataset (no records)")
        records = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError, StopIteration, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: cannot read {builder} data ({type(err).__name__}: {err})") from None
    if len(records) == 0:
        raise DataError(f"{path}: empty dataset (no records)")
    if builder == "csv":
        line_numbers = [i + 2 for i in range(len(records))]  # header is line 1
    return records, line_numbers


def _structure_key(record: dict, root: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(resolved structure path, designed chains, fixed chains) of a normalised record."""
    pdb_file = record["pdb_file"]
    path = Path(pdb_file) if Path(pdb_file).is_absolute() else root / pdb_file
    if record.get("chain_id") not in (None, ""):
        design = [str(record["chain_id"])]
    else:
        design = [str(c) for c in _as_list(record.get("design_chains"))]
    fixed = [str(c) for c in _as_list(record.get("fixed_chains"))]
    return str(path.resolve()), tuple(design), tuple(fixed)


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


def build_structures(
    keys: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]],
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, bool]:
    """Features of each structure key, parsed once and cached as Arrow; returns (table, loaded_from_cache)."""
    cache_root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_root / f"structures-{_fingerprint(keys)}"
    if target.is_dir():
        return datasets.load_from_disk(str(target)), True
    table = datasets.Dataset.from_dict(
        {
            "path": [k[0] for k in keys],
            "design_chains": [list(k[1]) for k in keys],
            "fixed_chains": [list(k[2]) for k in keys],
        }
    ).map(
        _featurize_structure,
        features=STRUCTURE_FEATURES,
        num_proc=num_proc if num_proc and num_proc > 1 and len(keys) > 1 else None,
        desc="Parsing structures",
        keep_in_memory=True,
    )
    if not any(table["error"]):
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        table.save_to_disk(str(tmp))
        tmp.rename(target)
        table = datasets.load_from_disk(str(target))
    return table, False


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
        raise ValueError(f"missing required field {name}")
    bad = sorted(set(seq) - set(ALPHABET))
    if bad:
        raise ValueError(f"{name} has letters outside the 20 amino acids + X: {''.join(bad)!r}")
    if len(seq) != expected:
        raise ValueError(
            f"{name} has length {len(seq)} but designed chains {list(chains)} of {pdb} "
            f"have {expected} residues"
        )
    return tokenize(seq)


PAIR_FIELDS = ("preferred_seq", "unpreferred_seq")
SEQUENCE_FIELDS = ("sequence", "wildtype_seq")  # a sequences file; wildtype_seq is optional


def load_pairs(
    path: str | Path,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    fields: tuple[str, str] = PAIR_FIELDS,
) -> PairDataset:
    """Load and validate a preference file; all bad records are reported together in one `DataError`.

    `fields` name the two sequences of a record (stored as `chosen` and `rejected`); with
    `SEQUENCE_FIELDS` a sequences file loads the same way, a missing `wildtype_seq` meaning the sequence.
    """
    path = Path(path)
    records, line_numbers = load_records(path)
    root = path.resolve().parent
    errors: list[str] = []
    keys: dict[tuple[str, tuple[str, ...], tuple[str, ...]], int] = {}
    record_keys: list[int] = []
    normalised = [_normalise(r) for r in records]
    for index, record in enumerate(normalised):
        label = _record_label(path, index, line_numbers)
        pdb_file = record.get("pdb_file")
        if not isinstance(pdb_file, str) or not pdb_file:
            errors.append(f"{label}: missing required field pdb_file (alias structure)")
            record_keys.append(-1)
            continue
        key = _structure_key(record, root)
        if not Path(key[0]).is_file():
            errors.append(f"{label}: structure file not found: {key[0]}")
            record_keys.append(-1)
            continue
        record_keys.append(keys.setdefault(key, len(keys)))
    if errors:
        _raise(errors)

    structures, _ = build_structures(list(keys), cache_dir=cache_dir, num_proc=num_proc)
    structure_errors = structures["error"]
    num_designed = structures["num_designed"]
    design_chains = structures["design_chains"]

    columns: dict[str, list] = {"structure_id": [], "chosen": [], "rejected": [], "mutable": [], "weight": []}
    for index, (record, sid) in enumerate(zip(normalised, record_keys, strict=True)):
        label = _record_label(path, index, line_numbers)
        if structure_errors[sid]:
            errors.append(f"{label}: {structure_errors[sid]}")
            continue
        pdb, chains = record["pdb_file"], tuple(design_chains[sid])
        try:
            first, second = fields
            if fields == SEQUENCE_FIELDS and record.get(second) is None:
                second = first
            chosen = _check_sequence(first, record.get(first), num_designed[sid], pdb, chains)
            rejected = _check_sequence(second, record.get(second), num_designed[sid], pdb, chains)
            mutable = _mutable_mask(record, num_designed[sid])
            weight = float(record["weight"]) if record.get("weight") is not None else 1.0
            if not np.isfinite(weight) or weight < 0:
                raise ValueError(f"weight must be a finite number >= 0, got {record['weight']!r}")
        except (ValueError, TypeError) as err:
            errors.append(f"{label}: {err}")
            continue
        columns["structure_id"].append(sid)
        columns["chosen"].append(chosen)
        columns["rejected"].append(rejected)
        columns["mutable"].append(mutable)
        columns["weight"].append(weight)
    if errors:
        _raise(errors)
    pairs = datasets.Dataset.from_dict(
        columns,
        features=datasets.Features(
            {
                "structure_id": datasets.Value("int32"),
                "chosen": datasets.Sequence(datasets.Value("int8")),
                "rejected": datasets.Sequence(datasets.Value("int8")),
                "mutable": datasets.Sequence(datasets.Value("int8")),
                "weight": datasets.Value("float32"),
            }
        ),
    )
    return PairDataset(pairs=pairs, structures=structures, source=str(path))


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
