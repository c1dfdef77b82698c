"""Backbone structures: Biopython parsing of PDB/mmCIF files into ProteinMPNN features."""

from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from Bio.Data.PDBData import nucleic_letters_3to1_extended, protein_letters_3to1_extended
from Bio.PDB import MMCIFParser, PDBParser
from Bio.PDB.Atom import Atom, DisorderedAtom
from Bio.PDB.Model import Model
from Bio.PDB.Residue import Residue

from dpo_inv.errors import StructureError

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
ALPHABET = AMINO_ACIDS + "X"  # ProteinMPNN token order; X (20) = unknown
TOKEN = np.full(256, -1, dtype=np.int8)
TOKEN[np.frombuffer(ALPHABET.encode(), dtype=np.uint8)] = np.arange(len(ALPHABET))
BACKBONE_ATOMS = ("N", "CA", "C", "O")
CHAIN_OFFSET = 100  # official ProteinMPNN adds 100 to residue_idx per chain
NUCLEOTIDES = frozenset(name.strip() for name in nucleic_letters_3to1_extended)
# The amino acids LigandMPNN's parser (ProDy's "protein" flag) takes as residues besides the standard ones.
MODIFIED_AMINO_ACIDS = frozenset(
    (  # noqa: SIM905
        "ASX GLX ASH GLH CSO CYX HIP HID HIE HSD HSE HSP HISD HISE HISP LYN TYM ARN MSE CME SEC SEP TPO PTR "
        "PHD XLE XAA MEN CSB"
    ).split()
)
STANDARD_AMINO_ACIDS = frozenset(
    "ALA ARG ASN ASP CYS GLN GLU GLY HIS ILE LEU LYS MET PHE PRO SER THR TRP TYR VAL".split()  # noqa: SIM905
)


@dataclass(frozen=True)
class ParseOptions:
    """Which residues a structure's chains hold, and the ligand context around them.

    ProteinMPNN models read residues as official ProteinMPNN does (ATOM records and selenomethionine).
    LigandMPNN-family models (`ligand_mpnn`) read them as LigandMPNN does: every residue with a CA atom whose
    name is a standard or modified amino acid (ATOM or HETATM; modified ones other than MSE as X), from atoms
    with occupancy > 0 and, where an atom has alternative locations, location A; their ligand context is
    every other non-water heavy atom (`ligand_context`), less the groups named in `ligand_exclude`.
    """

    ligand_mpnn: bool = False
    ligand_context: bool = True
    ligand_exclude: tuple[str, ...] = ()


PROTEINMPNN_PARSE = ParseOptions()  # how official ProteinMPNN reads structures


@dataclass(frozen=True)
class Chain:
    """One protein chain: observed residues in file order.

    `coords` holds N, CA, C, O per residue (NaN where an atom is missing); `positions` counts residues
    from the chain's first one following the author numbering, so a numbering gap is a positional gap
    and insertion codes take one position each, exactly as official ProteinMPNN pads its chains.
    `numbers` are the author residue numbers with insertion codes, as in the file ("52", "52A").
    """

    chain_id: str
    sequence: str
    coords: np.ndarray  # [L, 4, 3] float32
    positions: np.ndarray  # [L] int64
    numbers: tuple[str, ...]


@dataclass(frozen=True)
class Features:
    """ProteinMPNN input for designed chains followed by fixed (visible) chains."""

    X: np.ndarray  # [L, 4, 3] float32, 0 where missing
    mask: np.ndarray  # [L] float32, 1 where all four backbone atoms are present
    residue_idx: np.ndarray  # [L] int64
    chain_encoding: np.ndarray  # [L] int64, 1-based in chain order
    design_mask: np.ndarray  # [L] float32, 1 on designed chains
    native: np.ndarray  # [L] int64, native sequence tokens (ALPHABET indices)


def residue_letter(resname: str) -> str:
    """One-letter code; modified residues map to their standard parent (MSE -> M), others to X."""
    letter = protein_letters_3to1_extended.get(resname.strip().upper(), "X")
    return letter if letter in AMINO_ACIDS else "X"


def tokenize(sequence: str) -> np.ndarray:
    """Token indices into ALPHABET (-1 for any other character)."""
    return TOKEN[np.frombuffer(sequence.encode(), dtype=np.uint8)].astype(np.int64)


def _open_text(path: Path) -> io.TextIOBase:
    """Text of a plain or gzipped file, recognised by its first bytes, not by its name."""
    with open(path, "rb") as handle:
        gzipped = handle.read(2) == b"\x1f\x8b"
    return io.TextIOWrapper(gzip.open(path) if gzipped else open(path, "rb"), encoding="utf-8")


def _first_undecodable_line(path: Path) -> int:
    with _open_text(path) as handle:
        for number, line in enumerate(handle.buffer, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _is_mmcif(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    return ".cif" in suffixes or ".mmcif" in suffixes


def read_model(path: str | Path) -> Model:
    """The first model of a PDB or mmCIF file (optionally gzipped); a StructureError names what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise StructureError(f"{path}: structure file not found")
    mmcif = _is_mmcif(path)
    parser = MMCIFParser(QUIET=True) if mmcif else PDBParser(QUIET=True)
    try:
        with _open_text(path) as handle:
            structure = parser.get_structure(path.name, handle)
        model = next(iter(structure))
    except StopIteration:
        raise StructureError(
            f"{path}: no atomic coordinates found (no ATOM records); replace it with the complete "
            "structure file"
        ) from None
    except KeyError as err:  # an mmCIF file without its _atom_site table
        raise StructureError(
            f"{path}: no atomic coordinates found (mmCIF field {err.args[0]} missing); replace it with the "
            "complete structure file"
        ) from None
    except UnicodeDecodeError:
        raise StructureError(
            f"{path}: not UTF-8 text (line {_first_undecodable_line(path)}); give a PDB or mmCIF text file, "
            "plain or gzipped"
        ) from None
    except (EOFError, OSError, zlib.error) as err:
        raise StructureError(
            f"{path}: cannot read the file ({err}); replace it with a complete copy"
        ) from None
    except (ValueError, IndexError) as err:
        if str(err) == "Empty file.":
            raise StructureError(f"{path}: empty file; replace it with the complete structure file") from None
        where = "" if mmcif else f" at line {parser.structure_builder.line_counter}"
        raise StructureError(
            f"{path}: malformed or truncated {'mmCIF' if mmcif else 'PDB'} file{where} "
            f"({type(err).__name__}: {err}); replace it with the complete structure file"
        ) from None
    return model


def ligandmpnn_atom(atom: Atom) -> Atom | None:
    """The atom LigandMPNN reads: alternative location A where there is one, and only with occupancy > 0."""
    if isinstance(atom, DisorderedAtom) and atom.disordered_has_id("A"):
        atom = atom.disordered_get("A")
    return atom if (atom.get_occupancy() or 0.0) > 0 else None


def is_residue(residue: Residue, options: ParseOptions) -> bool:
    """Whether a residue is one of the chain's residues (rather than a ligand, water or nucleotide)."""
    resname = residue.get_resname().strip().upper()
    if not options.ligand_mpnn:
        return (residue.id[0] == " " and resname not in NUCLEOTIDES) or resname == "MSE"
    return (resname in STANDARD_AMINO_ACIDS or resname in MODIFIED_AMINO_ACIDS) and any(
        atom.get_id() == "CA" and ligandmpnn_atom(atom) for atom in residue
    )


def _backbone(residue: Residue, options: ParseOptions) -> list[np.ndarray]:
    missing = np.full(3, np.nan, dtype=np.float32)
    if not options.ligand_mpnn:
        return [residue[a].coord if a in residue else missing for a in BACKBONE_ATOMS]
    atoms = [ligandmpnn_atom(residue[a]) if a in residue else None for a in BACKBONE_ATOMS]
    return [missing if atom is None else atom.coord for atom in atoms]


def _letter(resname: str, options: ParseOptions) -> str:
    if options.ligand_mpnn and resname.strip().upper() not in STANDARD_AMINO_ACIDS | {"MSE"}:
        return "X"
    return residue_letter(resname)


def parse_structure(path: str | Path, options: ParseOptions = PROTEINMPNN_PARSE) -> dict[str, Chain]:
    """Parse the first model of a PDB or mmCIF file (optionally gzipped) into protein chains.

    As in official ProteinMPNN, residues come from ATOM records plus selenomethionine (MSE) HETATM records;
    other hetero groups (ligands, waters, other modified residues) and nucleic acids are not residues, so
    sequences match those the official tools produce. With `options.ligand_mpnn`, residues are LigandMPNN's
    (see `ParseOptions`). Chains without any residue are left out.
    """
    return protein_chains(read_model(path), path, options)


def protein_chains(
    model: Model, path: str | Path, options: ParseOptions = PROTEINMPNN_PARSE
) -> dict[str, Chain]:
    """The protein chains of a parsed model (see `parse_structure`)."""
    chains: dict[str, Chain] = {}
    for chain in model:
        letters, coords, numbers, labels = [], [], [], []
        for residue in chain:
            if not is_residue(residue, options):
                continue
            _, resseq, icode = residue.id
            letters.append(_letter(residue.get_resname(), options))
            coords.append(_backbone(residue, options))
            numbers.append(resseq)
            labels.append(f"{resseq}{icode.strip()}")
        if not letters:
            continue
        steps = np.maximum(np.diff(np.asarray(numbers, dtype=np.int64)), 1)
        chains[chain.id] = Chain(
            chain_id=chain.id,
            sequence="".join(letters),
            coords=np.asarray(coords, dtype=np.float32),
            positions=np.concatenate([[0], np.cumsum(steps)]).astype(np.int64),
            numbers=tuple(labels),
        )
    if not chains:
        raise StructureError(f"{path}: no protein chains found (no ATOM records); give a protein structure")
    return chains


def featurize(
    chains: dict[str, Chain],
    design_chains: list[str],
    fixed_chains: list[str],
    path: str | Path,
) -> Features:
    """Concatenate designed then fixed chains into ProteinMPNN features (official chain offsets)."""
    for chain_id in [*design_chains, *fixed_chains]:
        if chain_id not in chains:
            raise StructureError(
                f"{path}: chain {chain_id!r} not found (chains present: {', '.join(chains)}); "
                "fix chain_id, design_chains or fixed_chains"
            )
    if not design_chains:
        raise StructureError(f"{path}: no chain to design")
    overlap = set(design_chains) & set(fixed_chains)
    if overlap:
        raise StructureError(f"{path}: chains {sorted(overlap)} are both designed and fixed")

    X, residue_idx, chain_encoding, design_mask, native = [], [], [], [], []
    start = 0
    for number, chain_id in enumerate([*design_chains, *fixed_chains], start=1):
        chain = chains[chain_id]
        X.append(chain.coords)
        residue_idx.append(CHAIN_OFFSET * (number - 1) + start + chain.positions)
        chain_encoding.append(np.full(len(chain.sequence), number, dtype=np.int64))
        design_mask.append(np.full(len(chain.sequence), float(chain_id in design_chains), dtype=np.float32))
        native.append(tokenize(chain.sequence))
        start += int(chain.positions[-1]) + 1
    coords = np.concatenate(X)
    mask = np.isfinite(coords).all(axis=(1, 2)).astype(np.float32)
    if not mask[np.concatenate(design_mask) > 0].any():
        raise StructureError(
            f"{path}: designed chains {design_chains} have no residue with all four backbone atoms "
            "(N, CA, C, O); give a full-backbone model of them"
        )
    return Features(
        X=np.nan_to_num(coords, nan=0.0),
        mask=mask,
        residue_idx=np.concatenate(residue_idx),
        chain_encoding=np.concatenate(chain_encoding),
        design_mask=np.concatenate(design_mask),
        native=np.concatenate(native),
    )
