"""Cross-validation folds over one protein's labelled variants, grouped so that what is held out is new.

A random split over-states what a user will see: a single mutant whose position is also mutated in the
training part is predicted from that position's other labels. So records are grouped first, and every group
lies in one fold: single mutants by structure and position; other variants (multi-mutants, designs) with
every variant of their structure that differs from them at fewer than `NEAR_DUPLICATE` of the positions
either of them mutates (Hamming distance: near-duplicate designs; the combinations of a library stay
apart), as linked groups (single linkage); the wild type itself on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEAR_DUPLICATE = 0.25  # variants closer than this fraction of their mutated positions share a group


def variant_groups(
    variants: Sequence[np.ndarray], wildtypes: Sequence[np.ndarray], structures: Sequence[int]
) -> np.ndarray:
    """A group id per record: records of one group must not be split over folds."""
    parent = list(range(len(variants)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[int, int], int] = {}  # (structure, position) -> first single mutant there
    others: dict[int, list[int]] = {}  # structure -> its multi-mutants and designs
    for i, (variant, wildtype, sid) in enumerate(zip(variants, wildtypes, structures, strict=True)):
        changed = np.flatnonzero(np.asarray(variant) != np.asarray(wildtype))
        if len(changed) == 1:
            parent[i] = find(first.setdefault((int(sid), int(changed[0])), i))
        elif len(changed) > 1:
            others.setdefault(int(sid), []).append(i)
    for members in others.values():
        stacked = np.stack([np.asarray(variants[i]) for i in members])
        mutated = stacked != np.stack([np.asarray(wildtypes[i]) for i in members])
        for a in range(len(members)):
            limit = NEAR_DUPLICATE * (mutated[a + 1 :] | mutated[a]).sum(1)
            close = np.flatnonzero((stacked[a + 1 :] != stacked[a]).sum(1) < limit) + a + 1
            for b in close:
                parent[find(members[b])] = find(members[a])
    return np.array([find(i) for i in range(len(variants))])


def assign_folds(groups: np.ndarray, num_folds: int, seed: int) -> np.ndarray:
    """A fold per record: whole groups, largest first (ties in a seeded random order), each to the fold
    with the fewest records so far."""
    ids, sizes = np.unique(groups, return_counts=True)
    order = np.random.default_rng(seed).permutation(len(ids))
    order = order[np.argsort(-sizes[order], kind="stable")]
    load = np.zeros(num_folds, dtype=int)
    fold_of = {}
    for index in order:
        fold = int(np.argmin(load))
        fold_of[ids[index]] = fold
        load[fold] += sizes[index]
    return np.array([fold_of[g] for g in groups])
