"""The example oracle: fewer hydrophobic residues at solvent-exposed positions is better.

It labelled the bundled example pairs, and is a reward in the form `dpo-inv rounds` calls:

    reward: dpo_inv.tools.rewards:exposed_hydrophobic

A residue is exposed when fewer than `BURIED_NEIGHBOURS` other CA atoms of the designed chains lie within
`NEIGHBOUR_RADIUS` Å of its CA (fixed chains are not counted). The score of a sequence is minus the fraction
of hydrophobic residues (AVILMFWYC) among the exposed observed residues of its designed chains; the
per-residue score is 0 at an exposed hydrophobic residue and 1 elsewhere.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from dpo_inv.structures.parse import ParseOptions, featurize, parse_structure

HYDROPHOBIC = frozenset("AVILMFWYC")
NEIGHBOUR_RADIUS = 10.0
BURIED_NEIGHBOURS = 16


@lru_cache(maxsize=256)
def exposed_positions(pdb_file: str, design_chains: tuple[str, ...], ligand_mpnn: bool = False) -> np.ndarray:
    """[D] bool over the designed residues (ProteinMPNN's, or LigandMPNN's): observed and exposed."""
    chains = parse_structure(pdb_file, ParseOptions(ligand_mpnn=ligand_mpnn))
    features = featurize(chains, list(design_chains) or [next(iter(chains))], [], pdb_file)
    observed = features.mask > 0
    ca = features.X[:, 1]
    distances = np.linalg.norm(ca[:, None] - ca[None], axis=-1)
    close = (distances < NEIGHBOUR_RADIUS) & observed[None] & observed[:, None]
    neighbours = close.sum(-1) - 1
    exposed = observed & (neighbours < BURIED_NEIGHBOURS)
    return exposed


def _design_chains(record: dict) -> tuple[str, ...]:
    if record.get("chain_id"):
        return (str(record["chain_id"]),)
    return tuple(record.get("design_chains") or ())


def _exposed(record: dict) -> np.ndarray:
    """The exposure of the designed residues the record's sequence is for: ProteinMPNN's residues, or
    LigandMPNN's where their number differs and matches (modified amino acids count)."""
    key = (str(record["pdb_file"]), _design_chains(record))
    exposed = exposed_positions(*key)
    if len(record["sequence"]) != len(exposed):
        ligand = exposed_positions(*key, ligand_mpnn=True)
        if len(record["sequence"]) != len(ligand):
            raise ValueError(
                f"sequence has length {len(record['sequence'])}, the designed chains {len(exposed)} residues "
                f"({len(ligand)} as LigandMPNN reads them)"
            )
        return ligand
    return exposed


def residue_scores(record: dict) -> list[float]:
    """Per designed residue: 0 at an exposed hydrophobic residue, else 1."""
    exposed = _exposed(record)
    pairs = zip(record["sequence"], exposed, strict=True)
    return [0.0 if is_exposed and aa in HYDROPHOBIC else 1.0 for aa, is_exposed in pairs]


def exposed_hydrophobic(records: list[dict]) -> list[float]:
    """The oracle score of each record (`pdb_file`, `sequence`, chains): -(exposed hydrophobic fraction)."""
    scores = []
    for record in records:
        exposed = _exposed(record)
        per_residue = np.asarray(residue_scores(record))
        scores.append(-float((1 - per_residue[exposed]).mean()) if exposed.any() else 0.0)
    return scores
