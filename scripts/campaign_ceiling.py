"""How far a landscape's best variants are from what a model of independent sites can see: a ridge model
fitted on *every* measured variant of a landscape, with one term per site and residue (additive) or also one
per pair of sites and their two residues (pairwise), and where it ranks the variants within 0.95 of the best.

    python scripts/campaign_ceiling.py ../shared/campaign          # every landscape in the folder
    python scripts/campaign_ceiling.py ../shared/campaign/t7 --top 120

A campaign's predictor is fitted on a few hundred measurements, not on all of them: where even the additive
model that has seen the whole landscape ranks the best variants far below the number a campaign measures,
only the pair terms point at them, and a campaign must measure enough of each pair of residues to learn
them. One JSON line per landscape: variants, the share within 0.05 of zero, and for each model the
Spearman of its fit, the ranks of the variants within 0.95 of the best, and the best value among its top
`--top` (the size of the campaigns' whole measurement budget by default: 120 for three sites, 480 for four).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
BUDGET = {3: 120, 4: 480}  # measured in the suite's protocol: 24 + 4 x 24, 96 + 4 x 96


def features(variants: list[str], pairwise: bool) -> np.ndarray:
    """The indices of each variant's one-hot features ``[V, F]``: a residue at a site, and with
    `pairwise` a pair of residues at a pair of sites."""
    codes = np.array([[AMINO_ACIDS.index(a) for a in v] for v in variants])
    sites = codes.shape[1]
    columns = [codes[:, i] + 20 * i for i in range(sites)]
    if pairwise:
        for k, (i, j) in enumerate(itertools.combinations(range(sites), 2)):
            columns.append(20 * sites + 400 * k + 20 * codes[:, i] + codes[:, j])
    return np.stack(columns, axis=1)


def ridge(index: np.ndarray, y: np.ndarray, size: int, penalty: float = 1.0) -> np.ndarray:
    """Ridge predictions for one-hot features given by their indices (the Gram matrix is a count of the
    features that occur together)."""
    gram = np.zeros((size, size))
    for a, b in itertools.product(range(index.shape[1]), repeat=2):
        np.add.at(gram, (index[:, a], index[:, b]), 1.0)
    right = np.zeros(size)
    for a in range(index.shape[1]):
        np.add.at(right, index[:, a], y)
    weights = np.linalg.solve(gram + penalty * np.eye(size), right)
    return weights[index].sum(axis=1)


def ceiling(folder: Path, top: int | None) -> dict:
    with open(folder / "variants.csv") as handle:
        rows = list(csv.DictReader(handle))
    variants = [row["variant"] for row in rows]
    y = np.array([float(row["fitness"]) for row in rows])
    sites = len(variants[0])
    top = top or BUDGET.get(sites, 120)
    best = np.flatnonzero(y >= 0.95 * y.max())
    near_zero = round(float(np.mean(y <= 0.05 * y.max())), 3)
    result = {"landscape": folder.name, "variants": len(y), "near_zero": near_zero,
              "within_0.95_of_best": len(best), "top": top}  # fmt: skip
    for name, pairwise in (("additive", False), ("pairwise", True)):
        index = features(variants, pairwise)
        size = 20 * sites + (400 * sites * (sites - 1) // 2 if pairwise else 0)
        predicted = ridge(index, y, size)
        rank = np.empty(len(y), dtype=int)
        rank[np.argsort(-predicted, kind="stable")] = np.arange(len(y))
        result[name] = {
            "spearman": round(float(spearmanr(predicted, y).statistic), 3),
            "ranks_of_the_best": sorted(int(r) for r in rank[best]),
            "best_in_its_top": round(float(y[rank < top].max()), 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a landscape folder (variants.csv), or a folder of them")
    parser.add_argument("--top", type=int, default=None, help="the ranks counted as found (default: budget)")
    args = parser.parse_args()
    folders = [args.folder] if (args.folder / "variants.csv").is_file() else sorted(
        path.parent for path in args.folder.glob("*/variants.csv")
    )  # fmt: skip
    for folder in folders:
        print(json.dumps(ceiling(folder, args.top)), flush=True)


if __name__ == "__main__":
    main()
