"""Design targets of on-policy rounds: one JSON line per backbone to design, parsed and checked up front.

    {"pdb_file": "structures/1eteA.pdb.gz", "chain_id": "A"}
    {"pdb_file": "structures/1hvr.pdb.gz", "design_chains": ["A"], "fixed_chains": ["B"],
     "fixed_positions": "A:25-27"}

`pdb_file` is relative to the targets file's folder; `fixed_positions` uses the sampler's syntax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dpo_inv.data.dataset import structure_key
from dpo_inv.data.design import Design, parse_positions, prepare_design
from dpo_inv.data.records import DataError, raise_bad_records, read_records
from dpo_inv.structures.parse import PROTEINMPNN_PARSE, ParseOptions, StructureError


@dataclass(frozen=True)
class Targets:
    """The targets' Designs (parsed structures, designed chains first) and each one's fixed chains."""

    designs: list[Design]
    fixed_chains: list[list[str]]

    def __len__(self) -> int:
        return len(self.designs)


def _design(data: dict, root: Path, options: ParseOptions) -> tuple[Design, list[str]]:
    """One target's Design and fixed chains; a ValueError (or StructureError) says what is wrong."""
    path, design_chains, fixed_chains = structure_key(data, root, ())
    fixed = data.get("fixed_positions") or []
    specs = [fixed] if isinstance(fixed, str) else [str(s) for s in fixed]
    design = prepare_design(Path(path), design_chains, fixed_chains, parse_positions(specs), options)
    return design, list(fixed_chains)


def load_targets(path: str | Path, options: ParseOptions = PROTEINMPNN_PARSE) -> Targets:
    """The targets of a targets file, read as `options` say; every bad target is reported, one line each
    naming it."""
    path = Path(path)
    records = read_records(path)
    designs, fixed_chains, errors = [], [], []
    for record in records:
        if record.data is None:
            errors.append(f"{record.location}: {record.error}")
            continue
        try:
            design, fixed = _design(record.data, path.resolve().parent, options)
        except (ValueError, StructureError) as err:
            errors.append(f"{record.location}: {err}")
            continue
        designs.append(design)
        fixed_chains.append(fixed)
    if errors:
        raise_bad_records(errors)
    if not designs:
        raise DataError(f"{path}: no targets")
    return Targets(designs, fixed_chains)
