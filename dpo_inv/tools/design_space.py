"""A design space: the parent sequence, the positions that may change and to what, at most k mutations; its
candidates as token arrays, and mutations named as a lab names them (`V39F:D40W`, author numbering)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dpo_inv.data.proteingym import MUTATION, WILD_TYPE
from dpo_inv.errors import DataError, OptionError
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS, PROTEINMPNN_PARSE, ParseOptions, StructureError
from dpo_inv.tools.sample import fixed_indices, parse_fixed_positions, prepare_design

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
    """`variant_key` of each row of ``variants`` ``[R, L]``."""
    return np.array([variant_key(row) for row in variants])


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
        starts = dict(zip(design.design_chains, np.cumsum([0, *design.chain_lengths]).tolist(), strict=False))
        chains = {
            c: _Chain(c, [n for cc, n in design.residue_numbers if cc == c]) for c in design.design_chains
        }
        where = []
        for chain, ranges in parse_fixed_positions([positions], "--positions").items():
            if chain not in chains:
                raise StructureError(f"{structure}: --positions: chain {chain!r} is not designed "
                                     f"(designed: {', '.join(design.design_chains)})")  # fmt: skip
            indices = fixed_indices(chains[chain], ranges, Path(structure), "--positions")
            where += [starts[chain] + i for i in indices]
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


@dataclass(frozen=True)
class _Chain:
    """What `fixed_indices` reads of a chain: its id and author numbers."""

    chain_id: str
    numbers: list[str]
