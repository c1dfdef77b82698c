"""A batch that keeps exploring a library of few positions: beside the rule's highest draws, a share of the
batch goes far from the best variants measured. Thompson sampling alone locks in: the batch gathers round the
best found, a residue measured only beside poor ones looks poor to every member, and its pairs with residues
never measured beside it weigh nothing, so another region that holds the best is never measured again."""

from __future__ import annotations

import numpy as np

FAR_SHARE = 0.125  # of the batch: candidates FAR_DISTANCE or more substitutions from each of the FAR_OF best
FAR_DISTANCE = 3
FAR_OF = 10


def exploring_batch(draws: np.ndarray, candidates: np.ndarray, measured: np.ndarray, values: np.ndarray,
                    batch: int, rule: str) -> tuple[np.ndarray, list[str]]:  # fmt: skip
    """The batch (indices into ``candidates [R, P]``, the residues at a library's P positions; highest
    ``draws`` first) from the rule's ``draws [R]``: `FAR_SHARE` of it the highest draws among candidates
    `FAR_DISTANCE` or more substitutions from each of the `FAR_OF` best ``measured [N, P]`` (by ``values``;
    `far`), the rest the highest draws left (``rule``), and what picked each."""
    best = measured[np.argsort(-values, kind="stable")[:FAR_OF]]
    near = np.zeros(len(candidates), dtype=bool)
    for variant in best:
        near |= (candidates != variant).sum(1) < FAR_DISTANCE
    far = top(np.where(near, -np.inf, draws), int(FAR_SHARE * batch))
    rest = top(np.where(np.isin(np.arange(len(draws)), far), -np.inf, draws), batch - len(far))
    picked = np.concatenate([rest, far])
    rules = np.array([rule] * len(rest) + ["far"] * len(far))
    order = np.argsort(-draws[picked], kind="stable")
    return picked[order], rules[order].tolist()


def top(draws: np.ndarray, count: int) -> np.ndarray:
    """The indices of the ``count`` highest finite ``draws``, highest first."""
    order = np.argsort(-draws, kind="stable")[:count]
    return order[np.isfinite(draws[order])]
