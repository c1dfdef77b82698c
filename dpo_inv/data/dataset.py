"""Records of each kind (pairs, variants, labelled sequences, structures): loading, validation, the Arrow
cache of records and of their structures' features."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.table import InMemoryTable

from dpo_inv.data.featurized import FEATURES_VERSION, build_structures, cache_root, is_current
from dpo_inv.data.proteingym import GivenStructure, complete_records
from dpo_inv.data.records import (
    BadRecord,
    Data,
    DataError,
    Record,
    as_list,
    data_digest,
    data_name,
    is_file,
    raise_bad_records,
    read_records,
    records_folder,
)
from dpo_inv.data.saved import load_cached, load_saved, save_atomically, saved_made_of
from dpo_inv.errors import OptionError
from dpo_inv.structures.membrane import membrane_labels
from dpo_inv.structures.parse import (
    ALPHABET,
    PROTEINMPNN_PARSE,
    ParseOptions,
    protein_chains,
    read_model,
    tokenize,
)

STRUCTURE_FIELDS = ("pdb_file", "chain_id", "design_chains", "fixed_chains")  # name a record's structure
ALIASES = {
    "structure": "pdb_file",
    "chosen": "preferred_seq",
    "rejected": "unpreferred_seq",
    "seq": "sequence",
}


@dataclass(frozen=True)
class RecordSet:
    """Validated records of one kind (`records`, one row each) plus the features of every distinct
    (structure, chains) they use.

    `skipped` lists the bad records left out (with `on_bad_record="skip"`); `files` are the cache
    directories of the two tables, from which other processes load the same data (`load_saved_records`).
    """

    records: datasets.Dataset
    structures: datasets.Dataset
    source: str
    skipped: tuple[BadRecord, ...] = ()
    files: tuple[str, str] | None = None

    def lengths(self) -> np.ndarray:
        """Each record's structure length in residues."""
        return column(self.structures, "length")[column(self.records, "structure_id")]


def column(table: datasets.Dataset, name: str) -> np.ndarray:
    """A numeric column as one numpy array, that column alone read from Arrow at once (`table[name]` makes a
    Python object of each value, and on a selection of rows reads every column into memory)."""
    values = table.data.column(name).to_numpy()
    selection = table._indices  # the rows `Dataset.select` kept, None for the whole table
    return values if selection is None else values[selection.column(0).to_numpy()]


def structure_key(
    record: dict, root: Path, allowed: Sequence[Path], root_name: str = "the data file's folder"
) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(resolved structure path, designed chains, fixed chains) of a normalised record, a relative path
    being relative to `root` (`root_name` in errors); a ValueError says why the record names no usable
    structure file."""
    pdb_file = record.get("pdb_file")
    if not isinstance(pdb_file, str) or not pdb_file:
        raise DataError(
            "missing required field pdb_file (alias structure): the structure file's path; for a file that "
            "names none (ProteinGym's layout), give it once: --structure FILE [--chain_id A] or "
            "--proteingym_reference reference.csv"
        )
    path = (Path(pdb_file) if Path(pdb_file).is_absolute() else root / pdb_file).resolve()
    if allowed and not any(path.is_relative_to(folder) for folder in allowed):
        raise DataError(
            f"structure file {path} is outside structure_root ({', '.join(map(str, allowed))}); move it "
            "there or add its folder to structure_root"
        )
    if not path.is_file():
        raise DataError(f"structure file not found: {path} (a relative path is relative to {root_name})")
    if not os.access(path, os.R_OK):
        raise DataError(f"structure file not readable: {path} (permission denied)")
    if record.get("chain_id") not in (None, ""):
        design = [str(record["chain_id"])]
    else:
        design = [str(c) for c in as_list(record.get("design_chains"))]
    fixed = [str(c) for c in as_list(record.get("fixed_chains"))]
    return str(path), tuple(design), tuple(fixed)


def normalise(record: dict) -> dict:
    """The record with its aliased fields (structure, chosen, rejected, seq) under their own names."""
    out = dict(record)
    for alias, name in ALIASES.items():
        if out.get(name) is None and out.get(alias) is not None:
            out[name] = out[alias]
    return out


def _mutable_mask(record: dict, num_designed: int) -> np.ndarray:
    positions = as_list(record.get("mutable_positions"))
    ranges = as_list(record.get("mutable_ranges"))
    if positions and ranges:
        raise DataError("give mutable_positions or mutable_ranges, not both")
    if not positions and not ranges:
        return np.ones(num_designed, dtype=np.int8)
    if ranges:
        if any(not isinstance(r, (list, tuple)) or len(r) != 2 for r in ranges):
            raise DataError(f"mutable_ranges must be inclusive [start, end] pairs, got {ranges}")
        positions = [p for start, end in ranges for p in range(int(start), int(end) + 1)]
    mask = np.zeros(num_designed, dtype=np.int8)
    for p in positions:
        if not 0 <= int(p) < num_designed:
            raise DataError(f"mutable position {p} outside the designed sequence (0..{num_designed - 1})")
        mask[int(p)] = 1
    return mask


class LengthError(DataError):
    """A sequence whose length is not the designed chains' (`length` is the sequence's)."""

    def __init__(self, message: str, length: int) -> None:
        super().__init__(message)
        self.length = length


@functools.lru_cache(maxsize=64)
def _designed_length(path: str, chains: tuple[str, ...], options: ParseOptions) -> int | None:
    """The number of residues of `chains` of the structure at `path`, read as `options` say (None: a
    chain is missing or the file does not parse)."""
    try:
        parsed = protein_chains(read_model(path), path, options)
    except (OSError, ValueError):
        return None
    return sum(len(parsed[c].sequence) for c in chains) if set(chains) <= set(parsed) else None


def other_reading_hint(path: str, chains: tuple[str, ...], options: ParseOptions, length: int) -> str:
    """When a sequence of `length` residues fits `chains` as the other model family reads the structure
    (LigandMPNN counts modified residues, ProteinMPNN does not), the fix that says so; else nothing."""
    other = ParseOptions(ligand_mpnn=not options.ligand_mpnn)
    if _designed_length(path, chains, other) != length:
        return ""
    if other.ligand_mpnn:
        return "; it fits them as LigandMPNN models read them: give one, e.g. --model ligand/v_32_010_25"
    return "; it fits them as ProteinMPNN models read them: give one, e.g. --model vanilla/v_48_020"


def _check_sequence(name: str, seq: Any, expected: int, pdb: str, chains: tuple[str, ...]) -> np.ndarray:
    if not isinstance(seq, str) or not seq:
        alias = {v: k for k, v in ALIASES.items()}.get(name)
        raise DataError(f"missing required field {name}" + (f" (alias {alias})" if alias else ""))
    bad = sorted(set(seq) - set(ALPHABET))
    if bad:
        chains_hint = " (join the chains' sequences without /)" if "/" in bad else ""
        raise DataError(
            f"{name} has characters outside the 20 amino acids + X: {''.join(bad)!r}; write upper-case "
            f"one-letter codes{chains_hint}"
        )
    if len(seq) != expected:
        raise LengthError(
            f"{name} has length {len(seq)} but designed chains {list(chains)} of {pdb} have {expected} "
            "residues; give one letter per residue of the designed chains, in chain order",
            len(seq),
        )
    return tokenize(seq)


ARROW_BATCH = 65_536  # validated rows converted to Arrow at once
RESIDUE_SCORE_FIELDS = ("preferred_residue_scores", "unpreferred_residue_scores")
LABELS = {"true": 1, "false": 0, "1": 1, "0": 0}  # as text: JSON true, 1, CSV "True", "1"
ON_BAD_RECORD = ("fail", "skip")
TOKENS = datasets.Sequence(datasets.Value("int8"))
SCORES = datasets.Sequence(datasets.Value("float32"))


@dataclass(frozen=True)
class RecordKind:
    """What the records of a data file hold: the sequences stored for each (column: record field; a field
    marked optional falls back to `fallback`'s value, `"native"` to the structure's own sequence) and the
    other columns of the kind. Every kind shares the structure, `mutable_*`, `weight` and membrane fields."""

    name: str
    sequences: dict[str, str]
    optional: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # column -> where a missing one comes from
    columns: dict[str, datasets.Value | datasets.Sequence] = dataclasses.field(default_factory=dict)

    @property
    def features(self) -> datasets.Features:
        return datasets.Features(
            {
                "structure_id": datasets.Value("int32"),
                **{column: TOKENS for column in self.sequences},
                "mutable": TOKENS,
                "weight": datasets.Value("float32"),
                "membrane_labels": TOKENS,  # empty without membrane fields
                **self.columns,
            }
        )


PAIRS = RecordKind(
    "pairs",
    {"chosen": "preferred_seq", "rejected": "unpreferred_seq"},
    columns={"chosen_scores": SCORES, "rejected_scores": SCORES},  # empty without residue scores
)
VARIANTS = RecordKind(
    "variants", {"sequence": "sequence", "wildtype": "wildtype_seq"}, {"wildtype": "sequence"}
)
LABELLED = RecordKind(
    "labelled sequences", {"sequence": "sequence"}, columns={"label": datasets.Value("int8")}
)
STRUCTURES = RecordKind("structures", {"sequence": "sequence"}, {"sequence": "native"})
SEQUENCE_COLUMNS = ("chosen", "rejected", "sequence", "wildtype")  # every kind's sequence columns


def _label(value: Any) -> int:
    if isinstance(value, float) and value in (0.0, 1.0):
        value = int(value)
    key = str(value).strip().lower() if isinstance(value, (bool, int, str)) else None
    if key not in LABELS:
        raise DataError(f"label must be true (desirable) or false, got {value!r}")
    return LABELS[key]


def residue_score_list(value: Any, name: str, length: int) -> list[float]:
    """One finite number per designed residue (a list, or its JSON text from CSV); a ValueError says what
    is wrong."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = json.loads(value)
    if (
        not isinstance(value, list)
        or len(value) != length
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in value)
    ):
        shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:40]
        raise DataError(
            f"{name} must be a list of {length} finite numbers, one per designed residue, got {shown}; fix it"
        )
    return [float(v) for v in value]


def _residue_scores(data: dict, num_designed: int, required: bool) -> tuple[list[float], list[float]]:
    """The per-residue scores of a pair's two sequences, or two empty lists where the pair has none."""
    values = [data.get(name) for name in RESIDUE_SCORE_FIELDS]
    if all(v is None for v in values):
        if required:
            raise DataError(
                f"missing {' and '.join(RESIDUE_SCORE_FIELDS)}, which loss_type residpo needs: one number "
                "per designed residue of each sequence"
            )
        return [], []
    chosen, rejected = (
        residue_score_list(value, name, num_designed)
        for name, value in zip(RESIDUE_SCORE_FIELDS, values, strict=True)
    )
    return chosen, rejected


def _row(data: dict, kind: RecordKind, structure: dict, residue: bool) -> dict:
    """The stored columns of one record of `kind` on its `structure` (the columns error, num_designed,
    design_chains, residue_ids and native); a ValueError or TypeError says what is wrong."""
    num_designed, chains, pdb = structure["num_designed"], tuple(structure["design_chains"]), data["pdb_file"]
    if kind is STRUCTURES and data.get("preferred_seq") is not None:
        raise DataError(
            "a pair (preferred_seq) where structure records are read: loss_type sft alone trains on "
            "structures and their sequences; for the NLL of preferred sequences beside DPO give loss_type "
            "[sigmoid, sft], to train on a design name it sequence"
        )
    row: dict[str, Any] = {}
    for column, field in kind.sequences.items():
        fallback = kind.optional.get(column)
        if data.get(field) is None and fallback == "native":
            row[column] = np.asarray(structure["native"][:num_designed], np.int8)
        else:
            name = fallback if data.get(field) is None and fallback else field
            row[column] = _check_sequence(name, data.get(name), num_designed, pdb, chains)
    weight = float(data["weight"]) if data.get("weight") is not None else 1.0
    if not np.isfinite(weight) or weight < 0:
        raise DataError(f"weight must be a finite number >= 0, got {data['weight']!r}")
    row.update(
        mutable=_mutable_mask(data, num_designed),
        weight=weight,
        membrane_labels=membrane_labels(data, structure["residue_ids"]),
    )
    if kind is LABELLED:
        if data.get("label") is None:
            raise DataError("missing required field label: true for a desirable sequence, false otherwise")
        row["label"] = _label(data["label"])
    if kind is PAIRS:
        row["chosen_scores"], row["rejected_scores"] = _residue_scores(data, num_designed, residue)
    if kind is STRUCTURES and not (row["mutable"] * structure["observed"]).any():
        raise DataError(
            f"no designed residue of chains {list(chains)} of {pdb} is both observed and mutable: nothing to "
            "train on; design other chains or drop the record"
        )
    return row


def load_records(
    data: Data,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    kind: RecordKind = PAIRS,
    structure_roots: Sequence[str | Path] = (),
    on_bad_record: str = "fail",
    require_residue_scores: bool = False,
    options: ParseOptions = PROTEINMPNN_PARSE,
    name: str = "records",
    given: GivenStructure | None = None,
) -> RecordSet:
    """Load and validate a preference file, or records in memory (`name` names them in errors; their
    relative structure paths are relative to the working directory). Every record is checked; with
    `on_bad_record="fail"` all bad records are reported together in one `DataError`, with `"skip"` they
    are left out and listed in `skipped`. With `structure_roots`, structure files must lie in one of
    these folders.

    `kind` says what the records hold: `PAIRS` (stored as `chosen` and `rejected`, with their per-residue
    scores where they have them, required with `require_residue_scores`), `VARIANTS` (`sequence` and
    `wildtype`, a missing `wildtype_seq` meaning the sequence), `LABELLED` (`sequence` and `label`) or
    `STRUCTURES` (`sequence`, the structure's own where the record has none). Every kind keeps its membrane
    labels. `options` say how structures are read (LigandMPNN's residues and ligand context).
    Records that name no structure take ``given``'s, and a `mutant` its sequences (ProteinGym's layout).
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise OptionError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    records = None if is_file(data) and Path(data).is_file() else read_records(data, name)
    source = data_name(data, name)
    root = records_folder(data)
    allowed = [Path(folder).resolve() for folder in structure_roots]
    # validated once: cached under a name that changes with the data and the options
    digest = hashlib.sha256(
        json.dumps(
            [FEATURES_VERSION, dataclasses.astuple(options), *data_digest(data, records), str(root),
             kind.name, [str(a) for a in allowed], on_bad_record, require_residue_scores,
             given and dataclasses.astuple(given)]
        ).encode()
    ).hexdigest()[:20]  # fmt: skip
    records_dir = cache_root(cache_dir) / f"records-{digest}"
    cached = _validated_before(records_dir, source, options)
    if cached is not None:
        return cached
    records = records or read_records(data, name)
    if given is not None:
        records = complete_records(records, given)
    root_name = "the data file's folder" if is_file(data) else "the working directory"
    bad: dict[int, BadRecord] = {}
    keys, usable = _structure_keys(records, root, allowed, root_name, bad)
    structures, structures_dir = None, None
    batches: list[pa.RecordBatch] = []
    if keys:
        structures, structures_dir, _ = build_structures(list(keys), cache_dir, num_proc, options)
        batches = _record_batches(records, usable, structures, kind, options, require_residue_scores, bad)
    skipped = tuple(bad[number] for number in sorted(bad))
    if len(skipped) == len(records) > 1 and len({b.reason for b in skipped}) == 1:
        raise DataError(f"{source}: every one of its {len(records)} records: {skipped[0].reason}")
    if skipped and on_bad_record == "fail":
        raise_bad_records([str(b) for b in skipped])
    table = datasets.Dataset(InMemoryTable(pa.Table.from_batches(batches, schema=kind.features.arrow_schema)))
    if not table.num_rows:
        raise_bad_records(
            [*map(str, skipped), f"{source}: no usable record among {len(records)}; fix the records above"]
        )
    made_of = {"structures": structures_dir.name, "skipped": [dataclasses.asdict(b) for b in skipped]}
    save_atomically(table, records_dir, json.loads(json.dumps(made_of, default=str)))
    return RecordSet(
        records=load_saved(records_dir),
        structures=structures,
        source=source,
        skipped=skipped,
        files=(str(records_dir), str(structures_dir)),
    )


Key = tuple[str, tuple[str, ...], tuple[str, ...]]  # (structure file, designed chains, fixed chains)


def _structure_keys(
    records: list[Record], root: Path, allowed: list[Path], root_name: str, bad: dict[int, BadRecord]
) -> tuple[dict[Key, int], list[tuple[int, int]]]:
    """The distinct structures the records name (key -> structure id) and the (record number, structure id)
    of each record that names a usable one; the others go to `bad`. Each structure reference is checked
    once."""
    keys: dict[Key, int] = {}
    found: dict[tuple[str, ...], Key | str] = {}  # a structure reference's key, or why it has none
    usable: list[tuple[int, int]] = []
    for number, record in enumerate(records):
        if record.data is None:
            bad[number] = BadRecord(record.location, record.error)
            continue
        data = normalise(record.data)
        reference = tuple(repr(data.get(field)) for field in STRUCTURE_FIELDS)
        if reference not in found:
            try:
                found[reference] = structure_key(data, root, allowed, root_name)
            except ValueError as err:
                found[reference] = str(err)
        key = found[reference]
        if isinstance(key, str):
            bad[number] = BadRecord(record.location, key, record.data)
            continue
        usable.append((number, keys.setdefault(key, len(keys))))
    return keys, usable


def _record_batches(
    records: list[Record],
    usable: list[tuple[int, int]],
    structures: datasets.Dataset,
    kind: RecordKind,
    options: ParseOptions,
    require_residue_scores: bool,
    bad: dict[int, BadRecord],
) -> list[pa.RecordBatch]:
    """The stored rows of the usable records of `kind` on their parsed `structures`, as Arrow batches of
    `ARROW_BATCH` rows (compact, not a list per row); the records that fail validation go to `bad`."""
    # plain lists: one column read, not one per record
    read = {
        name: list(structures[name]) for name in ("error", "num_designed", "design_chains", "residue_ids")
    }
    if kind is STRUCTURES:  # the native sequence, and which of its designed residues are observed
        read["native"] = list(structures["native"])
        read["observed"] = [
            np.asarray(m[:n]) > 0 for m, n in zip(structures["mask"], read["num_designed"], strict=True)
        ]
    features = kind.features
    columns: dict[str, list] = {name: [] for name in features}
    batches: list[pa.RecordBatch] = []
    for number, sid in usable:
        location, data = records[number].location, normalise(records[number].data)
        if read["error"][sid]:
            bad[number] = BadRecord(location, read["error"][sid], records[number].data)
            continue
        try:
            row = _row(
                data, kind, {name: column[sid] for name, column in read.items()}, require_residue_scores
            )
        except LengthError as err:
            path, chains = structures[sid]["path"], tuple(read["design_chains"][sid])
            hint = other_reading_hint(path, chains, options, err.length)
            bad[number] = BadRecord(location, f"{err}{hint}", records[number].data)
            continue
        except (ValueError, TypeError) as err:
            bad[number] = BadRecord(location, str(err), records[number].data)
            continue
        for name, value in {"structure_id": sid, **row}.items():
            columns[name].append(value)
        if len(columns["structure_id"]) == ARROW_BATCH:
            batches.append(pa.RecordBatch.from_pydict(columns, schema=features.arrow_schema))
            columns = {name: [] for name in features}
    batches.append(pa.RecordBatch.from_pydict(columns, schema=features.arrow_schema))
    return batches


def _validated_before(records_dir: Path, source: str, options: ParseOptions) -> RecordSet | None:
    """The records cached in `records_dir`; None, the table removed, when the structures they were validated
    against have changed since."""
    records = load_cached(records_dir)
    if records is None:
        return None
    made_of = saved_made_of(records_dir)
    structures_dir = records_dir.parent / made_of["structures"]
    structures = load_cached(structures_dir)
    if structures is None or not is_current(structures, structures_dir, options):
        shutil.rmtree(records_dir)
        return None
    skipped = tuple(BadRecord(**record) for record in made_of["skipped"])
    return RecordSet(records, structures, source, skipped, (str(records_dir), str(structures_dir)))


def load_saved_records(files: tuple[str, str], source: str) -> RecordSet:
    """The records another process has loaded and validated (its `RecordSet.files`)."""
    records_dir, structures_dir = files
    records, structures = load_saved(Path(records_dir)), load_saved(Path(structures_dir))
    return RecordSet(records=records, structures=structures, source=source, files=files)
