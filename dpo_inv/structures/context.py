"""Ligand context: the atoms LigandMPNN sees around the residues (ligands, cofactors, ions, nucleic acids)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from Bio.PDB.Model import Model

from dpo_inv.structures.parse import ParseOptions, is_residue, ligandmpnn_atom

# Element symbols in order of atomic number (1-118).
ELEMENTS = (  # noqa: SIM905
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr Rb "
    "Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb Lu Hf "
    "Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh "
    "Hs Mt Ds Rg Cn Nh Fl Mc Lv Ts Og"
).split()
ATOMIC_NUMBER = {symbol.upper(): number for number, symbol in enumerate(ELEMENTS, start=1)}
# Residue names of water, as ProDy (LigandMPNN's parser) knows them.
WATER = frozenset(["HOH", "DOD", "WAT", "TIP3", "H2O", "OH2", "TIP", "TIP2", "TIP4", "SPC", "SOL", "T3P"])


@dataclass(frozen=True)
class ContextAtoms:
    """The context atoms of a structure: coordinates and atomic numbers."""

    xyz: np.ndarray  # [M, 3] float32
    element: np.ndarray  # [M] int8, atomic number

    def __len__(self) -> int:
        return len(self.element)


def context_atoms(model: Model, options: ParseOptions) -> ContextAtoms:
    """Every heavy atom of the model outside the chains' residues and water, as LigandMPNN's parser takes it:
    ligands, cofactors, metal ions and nucleic acids of every chain, from atoms with occupancy > 0 (location A
    of alternative ones). Hydrogens and atoms of unknown element are left out; so are residue names in
    `options.ligand_exclude`, and everything for ProteinMPNN models or with `options.ligand_context` off."""
    exclude = {name.upper() for name in options.ligand_exclude}
    xyz, element = [], []
    if options.ligand_mpnn and options.ligand_context:
        for residue in model.get_residues():
            resname = residue.get_resname().strip().upper()
            if resname in WATER or resname in exclude or is_residue(residue, options):
                continue
            for atom in residue:
                atom = ligandmpnn_atom(atom)
                number = None if atom is None else ATOMIC_NUMBER.get(atom.element.strip().upper())
                if number is not None and number > 1:
                    xyz.append(atom.coord)
                    element.append(number)
    return ContextAtoms(
        xyz=np.asarray(xyz, dtype=np.float32).reshape(-1, 3), element=np.asarray(element, dtype=np.int8)
    )


def empty_context_note(context_counts: dict[str, int], options: ParseOptions) -> str | None:
    """For LigandMPNN models with the ligand context on: a line naming the structures (name -> number of
    context atoms) whose context is empty; None when there are none."""
    empty = [name for name, count in context_counts.items() if count == 0]
    if not options.ligand_mpnn or not options.ligand_context or not empty:
        return None
    shown = ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else "")
    return (
        f"{len(empty)} of {len(context_counts)} structures have no ligand context atoms ({shown}): "
        "LigandMPNN sees their protein only"
    )


def periodic_group_and_period(number: int) -> tuple[int, int]:
    """IUPAC group (lanthanides and actinides: 3) and period of an element; (0, 0) for no element."""
    ends = (0, 2, 10, 18, 36, 54, 86, 118)
    if not 0 < number <= ends[-1]:
        return 0, 0
    period = next(p for p in range(1, len(ends)) if number <= ends[p])
    k = number - ends[period - 1]
    if period == 1:
        return (1 if k == 1 else 18), 1
    if k <= 2 or period in (4, 5):
        return k, period
    if period in (2, 3):
        return k + 10, period
    return (3 if k <= 17 else k - 14), period
