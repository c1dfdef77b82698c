"""Variant files as ProteinGym lays them out: `mutant` (`A23G`; several as `A23G:L45P`), `mutated_sequence`
and `DMS_score` per row, the structure and chains stated once for the whole file (`--structure` and
`--chain_id`, or ProteinGym's reference CSV: `DMS_filename`, `pdb_file`, `chain_id`).

`mutant` numbers residues from 1 along the designed chains' sequence, as ProteinGym does (`sequence`), or
by the structure's author numbering (`author`: `A23G`, `A52AG` with an insertion code, with several
designed chains the chain after the wild type, `LA23G`).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dpo_inv.data.records import DataError, Record
from dpo_inv.errors import OptionError
from dpo_inv.structures.parse import protein_chains, read_model

# wild type, chain (author numbering with several chains), number (insertion code too), new amino acid
MUTATION = re.compile(r"^([A-Z])([A-Za-z]?)(-?\d+[A-Za-z]?)([A-Z])$")
Numbering = Literal["sequence", "author"]
WILD_TYPE = ("", "WT", "_WT")  # how a scan names the wild type itself


@dataclass(frozen=True)
class GivenStructure:
    """The structure and designed chains (default: every protein chain) of the records that name none, and
    how their `mutant` numbers residues."""

    pdb_file: str
    chains: tuple[str, ...] = ()
    numbering: Numbering = "sequence"


def from_reference(reference: str | Path, data: str | Path, numbering: Numbering) -> GivenStructure:
    """The structure ProteinGym's reference CSV states for the scan file ``data`` (its `DMS_filename`):
    `pdb_file` relative to the reference's folder, `chain_id` if it has the column."""
    path = Path(reference)
    if not path.is_file():
        raise DataError(f"{path}: reference file not found")
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    missing = [column for column in ("DMS_filename", "pdb_file") if rows and column not in rows[0]]
    if not rows or missing:
        raise DataError(
            f"{path}: not a ProteinGym reference file: it needs the columns DMS_filename and pdb_file"
        )
    name = Path(data).name
    row = next((row for row in rows if row["DMS_filename"] == name), None)
    if row is None:
        raise DataError(f"{path}: no row with DMS_filename {name}; add one, or give --structure")
    chains = tuple(c for c in (row.get("chain_id") or "").replace(",", " ").split() if c)
    return GivenStructure(str((path.parent / row["pdb_file"]).resolve()), chains, numbering)


def complete_records(records: list[Record], given: GivenStructure) -> list[Record]:
    """Records that name no structure take ``given``'s; a record with a `mutant` and no `sequence` gets
    the variant's `sequence` (its `mutated_sequence`, or the wild type with the mutations applied) and
    its `wildtype_seq`. A mutant whose wild-type letter does not match is a bad record."""
    structure = read_model(given.pdb_file)
    chains = protein_chains(structure, given.pdb_file)
    designed = list(given.chains) or list(chains)
    missing = [c for c in designed if c not in chains]
    if missing:
        raise DataError(
            f"{given.pdb_file}: no protein chain {', '.join(missing)} (chains: {', '.join(chains)})"
        )
    wildtype = "".join(chains[c].sequence for c in designed)
    if given.numbering == "sequence":
        index = {str(i + 1): i for i in range(len(wildtype))}
    else:
        labels = [
            number if len(designed) == 1 else f"{c}{number}" for c in designed for number in chains[c].numbers
        ]
        index = {label: i for i, label in enumerate(labels)}
    completed = []
    for record in records:
        if record.data is None:
            completed.append(record)
            continue
        row = dict(record.data)
        if row.get("pdb_file") is None and row.get("structure") is None:
            row["pdb_file"] = given.pdb_file
            if given.chains and not any(row.get(f) for f in ("chain_id", "design_chains", "fixed_chains")):
                row["design_chains"] = list(given.chains)
        if row.get("mutant") is not None and row.get("sequence") is None and row.get("seq") is None:
            try:
                row |= variant_of(str(row["mutant"]), row.get("mutated_sequence"), wildtype, index, given)
            except ValueError as err:
                completed.append(Record(record.location, None, str(err)))
                continue
        completed.append(Record(record.location, row))
    return completed


def variant_of(
    mutant: str, mutated: str | None, wildtype: str, index: dict[str, int], given: GivenStructure
) -> dict[str, str]:
    """`sequence` and `wildtype_seq` of a `mutant` (with its `mutated_sequence` where the file has one)."""
    numbering = f"--mutant_numbering {given.numbering}"
    other = "author" if given.numbering == "sequence" else "sequence"
    sequence = list(mutated) if mutated else list(wildtype)
    parent = list(sequence)
    if mutant.strip().upper() in WILD_TYPE:
        return {"sequence": "".join(sequence), "wildtype_seq": "".join(parent)}
    for item in mutant.split(":"):
        match = MUTATION.match(item.strip())
        if match is None:
            raise DataError(f"mutant {item!r} is not a substitution such as A23G (wild type, number, new)")
        label = f"{match[2]}{match[3]}" if match[2] else match[3]
        if label not in index:
            raise DataError(f"mutant {item!r}: no residue {label} of the designed chains ({numbering}); if "
                             f"the numbers are the other kind, give --mutant_numbering {other}")  # fmt: skip
        i = index[label]
        if i >= len(sequence):
            raise DataError(f"mutant {item!r}: mutated_sequence has {len(sequence)} residues")
        if mutated:
            if sequence[i] != match[4]:
                raise DataError(
                    f"mutant {item!r}: mutated_sequence has {sequence[i]} at {label}, not {match[4]}"
                )
            parent[i] = match[1]
        else:
            if wildtype[i] != match[1]:
                raise DataError(
                    f"mutant {item!r}: the structure has {wildtype[i]} at {label} ({numbering}), not "
                    f"{match[1]}; check the structure and chain, or give --mutant_numbering {other}"
                )
            sequence[i] = match[4]
    return {"sequence": "".join(sequence), "wildtype_seq": "".join(parent)}


@dataclass(kw_only=True)
class StructureOptions:
    """How a data file's structures are found and read: the options that state a variant file's structure
    once (`score`, `adapt`, `pairs`), and the cache of parsed structures."""

    structure: str | None = field(
        default=None,
        metadata={"help": "The structure (PDB/mmCIF) of every record that names none, as in ProteinGym's "
                  "scans (mutant, mutated_sequence, DMS_score)."},
    )  # fmt: skip
    chain_id: list[str] = field(
        default_factory=list, metadata={"help": "With --structure: its designed chains (default: all)."}
    )
    proteingym_reference: str | None = field(
        default=None,
        metadata={"help": "Instead of --structure: ProteinGym's reference CSV; the row whose DMS_filename is "
                  "the data file's name gives pdb_file (relative to the CSV) and chain_id."},
    )  # fmt: skip
    mutant_numbering: Numbering = field(
        default="sequence",
        metadata={"help": "How a mutant (A23G) numbers residues: sequence (from 1 along the designed chains, "
                  "as ProteinGym) or author (the structure's residue numbers)."},
    )  # fmt: skip
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for parsed structures."})

    def given_structure(self, data: object) -> GivenStructure | None:
        """The structure these options state for ``data`` (a file, or records in memory), if any."""
        if self.structure is not None and self.proteingym_reference is not None:
            raise OptionError("give --structure or --proteingym_reference, not both")
        if self.proteingym_reference is not None:
            if not isinstance(data, (str, Path)):
                raise OptionError("--proteingym_reference finds a scan file's row: give the data as a file")
            return from_reference(self.proteingym_reference, data, self.mutant_numbering)
        if self.structure is None:
            if self.chain_id:
                raise OptionError("--chain_id without --structure: the records name their own chains")
            return None
        return GivenStructure(
            str(Path(self.structure).resolve()), tuple(self.chain_id), self.mutant_numbering
        )
