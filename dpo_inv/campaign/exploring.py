"""A batch that keeps exploring a library of few positions: beside the rule's highest draws, a share of the
batch goes to the single substitutions of the best variants measured, so that every residue is tried beside
the best residues found. Thompson sampling alone locks in: a residue measured only beside poor ones looks
poor to every member, its pairs with the best residues, never measured, weigh nothing, and batch after batch
gathers round the best found."""

from __future__ import annotations

import numpy as np

NEAR_SHARE = 0.25  # of the batch: single substitutions of the NEAR_OF best measured variants
NEAR_OF = 3


def exploring_batch(draws: np.ndarray, candidates: np.ndarray, measured: np.ndarray, values: np.ndarray,
                    batch: int, rule: str) -> tuple[np.ndarray, list[str]]:  # fmt: skip
    """The batch (indices into ``candidates [R, P]``, the residues at a library's P positions; highest
    ``draws`` first) from the rule's ``draws [R]``: `NEAR_SHARE` of it the highest draws among the single
    substitutions of the `NEAR_OF` best ``measured [N, P]`` (by ``values``; `near_best`), the rest the
    highest draws left (``rule``), and what picked each."""
    best = measured[np.argsort(-values, kind="stable")[:NEAR_OF]]
    near = np.zeros(len(candidates), dtype=bool)
    for variant in best:
        near |= (candidates != variant).sum(1) == 1
    local = top(np.where(near, draws, -np.inf), int(NEAR_SHARE * batch))
    rest = top(np.where(np.isin(np.arange(len(draws)), local), -np.inf, draws), batch - len(local))
    picked = np.concatenate([rest, local])
    rules = np.array([rule] * len(rest) + ["near_best"] * len(local))
    order = np.argsort(-draws[picked], kind="stable")
    return picked[order], rules[order].tolist()


def top(draws: np.ndarray, count: int) -> np.ndarray:
    """The indices of the ``count`` highest finite ``draws``, highest first."""
    order = np.argsort(-draws, kind="stable")[:count]
    return order[np.isfinite(draws[order])]
