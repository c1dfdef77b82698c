"""What is designed in a structure, before any model: the positions syntax (`"A:1-10,15 B:52A"`, author
numbers with insertion codes), LigandMPNN's redesigned residues and ProteinMPNN's tied positions; the designed
chains, their offsets in the concatenated sequence and which of their residues are fixed (`Design`, the
`collate` example sample, rounds and propose score or decode); and a design space: the parent sequence, the
positions that may change and to what, at most k mutations, its candidates as token arrays and mutations
named as a lab names them (`V39F:D40W`, author numbering)."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dpo_inv.data.proteingym import MUTATION, WILD_TYPE
from dpo_inv.errors import DataError, OptionError, StructureError
from dpo_inv.structures.context import context_atoms
from dpo_inv.structures.parse import (
    ALPHABET,
    AMINO_ACIDS,
    PROTEINMPNN_PARSE,
    Chain,
    ParseOptions,
    featurize,
    protein_chains,
    read_model,
)

STRUCTURE_SUFFIXES = (".gz", ".pdb", ".ent", ".cif", ".mmcif")
RESIDUE = r"-?\d+[A-Z]?"
RESIDUE_RANGE = re.compile(rf"^({RESIDUE})(?:-({RESIDUE}))?$")

Ranges = dict[str, list[tuple[str, str]]]  # the residue ranges (first, last author number) of each chain
Tie = list[tuple[str, list[tuple[str, str]]]]  # the residue ranges of each chain of one tie


def parse_positions(specs: Sequence[str], option: str = "--fixed_positions") -> Ranges:
    """ProteinMPNN's positions syntax, author numbers: ``["A:1-10,15 B:3"]`` ->
    ``{"A": [("1", "10"), ("15", "15")], "B": [("3", "3")]}``; ``option`` names the option in errors."""
    ranges: Ranges = {}
    for token in " ".join(specs).split():
        chain_id, _, residues = token.partition(":")
        if not chain_id or not residues:
            raise OptionError(f"{option}: {token!r} is not CHAIN:RESIDUES such as A:1-10,15")
        for item in residues.split(","):
            match = RESIDUE_RANGE.match(item.upper())
            if match is None:
                raise OptionError(
                    f"{option}: {item!r} (chain {chain_id}) is not a residue number or range "
                    "such as 15, 52A or 1-10"
                )
            ranges.setdefault(chain_id, []).append((match[1], match[2] or match[1]))
    return ranges


def parse_redesigned_residues(spec: str) -> Ranges:
    """LigandMPNN's ``"A12 A13 B52A"`` (or ``"A:12-20,25"``) -> ``{"A": [("12", "12"), ...], ...}``."""
    if ":" in spec:
        return parse_positions([spec], "--redesigned_residues")
    residues: Ranges = {}
    for token in spec.split():
        match = re.match(rf"^([A-Za-z]+)({RESIDUE})$", token)
        if match is None:
            raise OptionError(f"--redesigned_residues: {token!r} is not CHAIN+NUMBER such as A12 or B52A")
        residues.setdefault(match[1], []).append((match[2].upper(), match[2].upper()))
    return residues


def parse_tied_positions(specs: Sequence[str]) -> list[Tie]:
    """``["A:1-10=B:1-10"]`` -> ``[[("A", [("1", "10")]), ("B", [("1", "10")])]]``."""
    ties = []
    for token in " ".join(specs).split():
        sides = [parse_positions([side], "--tied_positions") for side in token.split("=")]
        if len(sides) < 2 or any(len(side) != 1 for side in sides):
            raise OptionError(
                f"--tied_positions: {token!r} is not CHAIN:RESIDUES=CHAIN:RESIDUES such as A:1-10=B:1-10"
            )
        ties.append([next(iter(side.items())) for side in sides])
    return ties


def chain_indices(
    chain: Chain, ranges: list[tuple[str, str]], path: Path, option: str = "--fixed_positions"
) -> list[int]:
    """Indices into ``chain`` of the residues from ``start`` to ``end`` (file order) of each range."""
    index = {number: i for i, number in enumerate(chain.numbers)}
    indices: list[int] = []
    for start, end in ranges:
        for number in (start, end):
            if number not in index:
                raise StructureError(
                    f"{path}: {option}: chain {chain.chain_id} has no residue {number} "
                    f"(residues {chain.numbers[0]}..{chain.numbers[-1]})"
                )
        if index[end] < index[start]:
            raise StructureError(
                f"{path}: {option}: range {start}-{end} of chain {chain.chain_id} runs backwards"
            )
        indices.extend(range(index[start], index[end] + 1))
    return indices


def chain_starts(chains: dict[str, Chain], design: Sequence[str]) -> dict[str, int]:
    """Where each designed chain starts in the designed chains' concatenated sequence."""
    lengths = [len(chains[c].sequence) for c in design]
    return dict(zip(design, np.cumsum([0, *lengths]).tolist(), strict=False))


def designed_indices(
    chains: dict[str, Chain], design: Sequence[str], ranges: Ranges, path: Path, option: str
) -> list[int]:
    """Indices into the designed chains' concatenated sequence of the residues of ``ranges``, chain by
    chain; a chain of ``ranges`` that is not designed is refused."""
    starts = chain_starts(chains, design)
    indices = []
    for chain_id, chain_ranges in ranges.items():
        if chain_id not in design:
            raise StructureError(
                f"{path}: {option}: chain {chain_id!r} is not designed (designed: {', '.join(design)})"
            )
        indices += [starts[chain_id] + i for i in chain_indices(chains[chain_id], chain_ranges, path, option)]
    return indices


def tied_groups(
    chains: dict[str, Chain], design: list[str], ties: list[Tie], homo_oligomer: bool, path: Path
) -> list[list[int]]:
    """The groups of tied positions (indices into the designed chains' concatenated sequence) of ``ties``,
    or of every designed chain residue by residue with ``homo_oligomer``."""
    starts = chain_starts(chains, design)
    if homo_oligomer:
        lengths = {c: len(chains[c].sequence) for c in design}
        if len(set(lengths.values())) > 1:
            raise StructureError(f"{path}: --homo_oligomer: the designed chains differ in length ({lengths})")
        return [[starts[c] + i for c in design] for i in range(lengths[design[0]])] if len(design) > 1 else []
    groups = []
    for tie in ties:
        sides = [designed_indices(chains, design, {c: r}, path, "--tied_positions") for c, r in tie]
        if len({len(side) for side in sides}) > 1:
            raise StructureError(
                f"{path}: --tied_positions: {'='.join(c for c, _ in tie)} tie {[len(s) for s in sides]} "
                "residues; give equally many on each side"
            )
        groups += [list(group) for group in zip(*sides, strict=True)]
    return groups


def structure_name(path: Path) -> str:
    """File name without structure suffixes: ``1eteA.pdb.gz`` -> ``1eteA``."""
    name = path.name
    while Path(name).suffix.lower() in STRUCTURE_SUFFIXES:
        name = Path(name).stem
    return name


@dataclass(frozen=True)
class Design:
    """One structure to design: its designed chains, in order, and its ``collate`` example (designed chains
    first, then the fixed ones)."""

    path: Path
    name: str
    chains: dict[str, Chain]  # the designed chains, in order
    example: dict[str, Any]
    tied: np.ndarray  # each position's tie head (its own index when not tied)
    num_context_atoms: int = 0

    @property
    def design_chains(self) -> list[str]:
        return list(self.chains)

    @property
    def chain_lengths(self) -> list[int]:
        return [len(chain.sequence) for chain in self.chains.values()]

    @property
    def residue_numbers(self) -> list[tuple[str, str]]:
        """(chain, author number) of each designed residue, in order."""
        return [(c, number) for c, chain in self.chains.items() for number in chain.numbers]

    def indices(self, ranges: Ranges, option: str) -> list[int]:
        """Indices into the designed chains' concatenated sequence of the residues of ``ranges``."""
        return designed_indices(self.chains, self.design_chains, ranges, self.path, option)


def prepare_design(
    path: Path,
    design_chains: Sequence[str],
    fixed_chains: Sequence[str],
    fixed_positions: Ranges,
    options: ParseOptions = PROTEINMPNN_PARSE,
    ties: Sequence[Tie] = (),
    homo_oligomer: bool = False,
    redesigned: Ranges | None = None,
) -> Design:
    """Parse and featurize ``path`` as ``options`` say; without ``design_chains``, every chain not fixed is
    designed; with ``redesigned``, only those residues of them. Tied residues (``ties``, or
    ``homo_oligomer``) get one amino acid; a missing one is left out of its tie."""
    structure = read_model(path)
    chains = protein_chains(structure, path, options)
    design = list(design_chains) or [c for c in chains if c not in fixed_chains]
    features = featurize(chains, design, list(fixed_chains), path)
    num_designed = int(features.design_mask.sum())
    mutable = np.ones(num_designed, dtype=np.float32)
    option = "--fixed_positions" if redesigned is None else "--redesigned_residues"
    ranges = fixed_positions if redesigned is None else redesigned
    if redesigned is not None:
        mutable[:] = 0
    for chain_id, chain_ranges in ranges.items():
        if chain_id not in chains:
            raise StructureError(
                f"{path}: {option}: chain {chain_id!r} not found (chains present: {', '.join(chains)})"
            )
        mutable[designed_indices(chains, design, {chain_id: chain_ranges}, path, option)] = (
            0 if redesigned is None else 1
        )
    if not (mutable * features.mask[:num_designed]).any():
        what = "fixes every" if redesigned is None else "designs no"
        raise StructureError(f"{path}: {option} {what} observed residue of chains {design}")
    tied = np.arange(len(features.mask))
    for group in tied_groups(chains, design, list(ties), homo_oligomer, path):
        present = [i for i in group if features.mask[i]]
        if not all(mutable[present]) and any(mutable[present]):
            raise StructureError(
                f"{path}: --tied_positions: a tie holds fixed and designed residues; fix all or none"
            )
        if len(present) > 1 and all(mutable[present]):
            if (tied[present] != present).any():
                raise StructureError(
                    f"{path}: --tied_positions: a residue is in two ties; merge them into one"
                )
            tied[present] = present[0]
    example = {
        "X": features.X,
        "mask": features.mask,
        "residue_idx": features.residue_idx,
        "chain_encoding": features.chain_encoding,
        "native": features.native,
        "mutable": mutable,
        "weight": 1.0,
        "index": 0,
    }
    context = context_atoms(structure, options)
    example |= {"context_xyz": context.xyz.reshape(-1), "context_element": context.element}
    designed = {c: chains[c] for c in design}
    return Design(path, structure_name(path), designed, example, tied, len(context))


MAX_CANDIDATES = 2_000_000  # variants a design space may enumerate: a larger one is sampled


@dataclass(frozen=True)
class DesignSpace:
    """The parent (tokens of the designed chains, in order), where it may change and to what.

    ``numbers`` name each designed position by chain and author number; a mutation is written
    `{parent}{number}{amino acid}` (`V39F`) with one designed chain, `{parent}{chain}{number}{amino acid}`
    (`VA39F`, FoldX's form) with several; several are joined by `:` as ProteinGym joins them."""

    parent: np.ndarray  # [L] tokens
    numbers: list[tuple[str, str]]  # (chain, author number) of each position
    positions: np.ndarray  # indices of the positions that may change, sorted
    allowed: list[np.ndarray]  # per position of `positions`, the tokens allowed there (the parent's left out)
    max_mutations: int

    @cached_property
    def labels(self) -> list[str]:
        """How each position is named in a mutation: its author number, chain first with several chains."""
        one_chain = len({c for c, _ in self.numbers}) == 1
        return [number if one_chain else f"{chain}{number}" for chain, number in self.numbers]

    @cached_property
    def index(self) -> dict[str, int]:
        """The position of each label."""
        return {label: i for i, label in enumerate(self.labels)}

    def mutations(self, variant: np.ndarray) -> str:
        """The variant's mutations from the parent, `V39F:D40W` (empty for the parent)."""
        changed = np.flatnonzero(variant != self.parent)
        return ":".join(f"{ALPHABET[self.parent[i]]}{self.labels[i]}{ALPHABET[variant[i]]}" for i in changed)

    def parse(self, mutations: str, where: str) -> np.ndarray:
        """Tokens of the variant named by `mutations` (`V39F:D40W`; empty, `WT` or `_wt` for the parent);
        a `ValueError` prefixed with ``where`` names what is wrong."""
        variant = self.parent.copy()
        text = mutations.strip()
        if text.upper() in WILD_TYPE:
            return variant
        for item in text.split(":"):
            match = MUTATION.match(item.strip())
            if match is None:
                raise DataError(f"{where}: {item!r} is not a mutation such as V39F (parent, number, new)")
            name = f"{match[2]}{match[3]}" if match[2] else match[3]
            if name not in self.index:
                raise DataError(
                    f"{where}: {item!r}: no designed residue {name} (author numbering of "
                    f"the designed residues: {self.labels[0]}..{self.labels[-1]})"
                )
            i = self.index[name]
            if ALPHABET[self.parent[i]] != match[1]:
                raise DataError(
                    f"{where}: {item!r}: the parent has {ALPHABET[self.parent[i]]} at {name}, not {match[1]}"
                )
            variant[i] = ALPHABET.index(match[4])
        return variant

    def contains(self, variant: np.ndarray) -> bool:
        """Whether ``variant`` is in the space: at most k mutations, each at a position that may change, to
        an amino acid allowed there."""
        changed = np.flatnonzero(variant != self.parent)
        where = np.searchsorted(self.positions, changed)
        if len(changed) > self.max_mutations or (where >= len(self.positions)).any():
            return False
        return all(
            p == self.positions[w] and variant[p] in self.allowed[w]
            for p, w in zip(changed, where, strict=True)
        )

    def size(self) -> int:
        """How many variants the space holds (the parent included)."""
        counts = [len(a) for a in self.allowed]
        return sum(
            math.prod(combo)
            for k in range(self.max_mutations + 1)
            for combo in itertools.combinations(counts, k)
        )

    def enumerate(self) -> np.ndarray:
        """Every variant of the space but the parent, ``[R, L]`` tokens as bytes (a four-site library on 400
        residues: 64 MB, not 512)."""
        rows = []
        for k in range(1, self.max_mutations + 1):
            for chosen in itertools.combinations(range(len(self.positions)), k):
                grid = np.array(list(itertools.product(*(self.allowed[c] for c in chosen))), dtype=np.uint8)
                block = np.repeat(self.parent[None, :].astype(np.uint8), len(grid), 0)
                block[:, self.positions[list(chosen)]] = grid
                rows.append(block)
        return np.concatenate(rows) if rows else np.zeros((0, len(self.parent)), dtype=np.uint8)


def variant_key(variant: np.ndarray) -> bytes:
    """A key of ``variant``'s tokens (of any integer type): equal variants, equal keys."""
    return np.ascontiguousarray(variant, dtype=np.uint8).tobytes()


def variant_keys(variants: np.ndarray) -> np.ndarray:
    """`variant_key` of each row of ``variants`` ``[R, L]``, as an object array: a numpy bytes array would
    drop each key's trailing zero bytes (alanine is token 0)."""
    keys = np.empty(len(variants), dtype=object)
    keys[:] = [variant_key(row) for row in variants]
    return keys


def parse_allowed(spec: str, positions: Sequence[str]) -> dict[str, str]:
    """``--allowed_aas``: ``"ACDE"`` for every position, or ``"39:AVILM 40:FWY"`` per position (author
    numbers; positions not named allow every amino acid)."""
    spec = spec.strip()
    if not spec:
        return {}
    if ":" not in spec:
        letters = spec.replace(",", "").upper()
        check_letters(letters, spec)
        return {p: letters for p in positions}
    allowed = {}
    for item in spec.split():
        number, _, letters = item.partition(":")
        letters = letters.upper()
        check_letters(letters, item)
        allowed[number] = letters
    return allowed


def check_letters(letters: str, spec: str) -> None:
    bad = sorted(set(letters) - set(AMINO_ACIDS))
    if not letters or bad:
        raise OptionError(f"--allowed_aas: {spec!r}: give amino acids of {AMINO_ACIDS} (not {''.join(bad)})")


def read_design_space(
    structure: str,
    chain_id: Sequence[str],
    positions: str = "",
    allowed_aas: str = "",
    max_mutations: int = 1,
    parent: str | None = None,
    options: ParseOptions = PROTEINMPNN_PARSE,
) -> tuple[DesignSpace, dict[str, Any]]:
    """The design space of ``structure``'s designed chains (default: all) and the structure's `collate`
    example: the residues of ``positions`` (ProteinMPNN's syntax, author numbers; default: every observed
    designed residue) may change to ``allowed_aas`` (`parse_allowed`), at most ``max_mutations`` of them,
    from ``parent`` (mutations of the structure's sequence; default: that sequence); the structure read as
    ``options`` say (a LigandMPNN model's: with its ligand context)."""
    design = prepare_design(Path(structure), chain_id, [], {}, options)
    parent_tokens = np.asarray(design.example["native"][: len(design.residue_numbers)]).copy()
    space = DesignSpace(parent_tokens, design.residue_numbers, np.zeros(0, np.int64), [], max_mutations)
    if parent:
        parent_tokens = space.parse(parent, "--parent")
    if positions:
        where = design.indices(parse_positions([positions], "--positions"), "--positions")
        changing = np.array(sorted(set(where)), dtype=np.int64)
    else:
        changing = np.flatnonzero(np.asarray(design.example["mask"][: len(parent_tokens)]) > 0)
    labels = [space.labels[i] for i in changing]
    allowed_letters = parse_allowed(allowed_aas, labels)
    unknown = sorted(set(allowed_letters) - set(labels))
    if unknown:
        raise OptionError(f"--allowed_aas: {', '.join(unknown)} not among --positions ({', '.join(labels)})")
    allowed = [
        np.array([t for t in (ALPHABET.index(a) for a in allowed_letters.get(label, AMINO_ACIDS))
                  if t != parent_tokens[i]])
        for label, i in zip(labels, changing, strict=True)
    ]  # fmt: skip
    space = DesignSpace(parent_tokens, design.residue_numbers, changing, allowed, max_mutations)
    return space, design.example
