"""Simulated design campaigns on a combinatorially complete landscape, against the field's baselines.

    python scripts/campaign_benchmark.py --landscape ../shared/campaign/trpb --initial 96 --rounds 4 \\
        --batch 96 --seeds 10 [--first_round zero_shot]

A landscape folder holds `landscape.json` (pdb_file, chain_id, wildtype_seq, site_indices) and
`variants.csv` (`variant`: the letters at the sites, in order; `fitness`). The oracle reveals only what was
proposed; the candidates are the landscape's variants (combinations never measured cannot be proposed). Each
campaign measures `--initial` variants (at random, or the zero-shot model's best with `--first_round
zero_shot`), then `--rounds` batches of `--batch`. Methods, in the same runs:

- dpo_inv: what `dpo_inv.propose` does — the ensemble ridge on one-hot, pair and zero-shot features,
  Thompson sampling;
- augmented_ridge: the same ensemble and batch rule on one-hot and zero-shot features (MLDE-style);
- greedy_zero_shot: the zero-shot joint score's best not yet measured;
- random.

Printed last, one JSON line: per method and round, the mean and standard error over seeds of the best fitness
found over the landscape's best (`best_fraction`) and of the fraction of its top 1% found (`top1_found`).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np
import torch

from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.acquisition import choose_batch, top_batch
from dpo_inv.tools.propose import ProposeConfig, design_space, zero_shot

METHODS = ("dpo_inv", "augmented_ridge", "greedy_zero_shot", "random")


def load_landscape(folder: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """The landscape's description, its variants' letters at the sites ``[N, m]`` and their fitness."""
    landscape = json.loads((folder / "landscape.json").read_text())
    with open(folder / "variants.csv") as handle:
        rows = list(csv.DictReader(handle))
    letters = np.array([[ALPHABET.index(a) for a in row["variant"]] for row in rows])
    return landscape, letters, np.array([float(row["fitness"]) for row in rows])


def campaign(method: str, seed: int, variants: np.ndarray, fitness: np.ndarray, scores: np.ndarray,
             parent: np.ndarray, args: argparse.Namespace) -> list[tuple[float, float]]:  # fmt: skip
    """One campaign: (best fraction, top-1% fraction found) after the first batch and after each round."""
    rng = np.random.default_rng(seed)
    top = set(np.argsort(-fitness)[: max(1, round(0.01 * len(fitness)))].tolist())
    if args.first_round == "random":
        measured = list(rng.choice(len(fitness), args.initial, replace=False))
    else:
        measured = list(top_batch(scores, args.initial))
    history = []
    for round_ in range(args.rounds + 1):
        history.append((fitness[measured].max() / fitness.max(), len(top & set(measured)) / len(top)))
        if round_ == args.rounds:
            break
        left = np.setdiff1d(np.arange(len(fitness)), measured)
        if method == "random":
            picked = rng.choice(left, args.batch, replace=False)
        elif method == "greedy_zero_shot":
            picked = left[top_batch(scores[left], args.batch)]
        else:
            known, draw = np.array(measured), seed * 100 + round_
            chosen, _, _ = choose_batch(variants[known], fitness[known], scores[known], variants[left],
                                        scores[left], parent, args.batch, "thompson", fit_seed=draw,
                                        draw_seed=draw, pairwise=method == "dpo_inv")  # fmt: skip
            picked = left[chosen]
        measured += list(picked)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--landscape", type=Path, required=True)
    parser.add_argument("--model", default="vanilla/v_48_020")
    parser.add_argument("--initial", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first_round", choices=("random", "zero_shot"), default="random")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args = parser.parse_args()
    start = time.time()
    landscape, letters, fitness = load_landscape(args.landscape)
    sites = np.array(landscape["site_indices"])
    chain = landscape["chain_id"]
    numbers = ",".join(str(n) for n in landscape["site_numbers"])
    structure = str(args.landscape / landscape["pdb_file"])
    config = ProposeConfig(campaign="", structure=structure, chain_id=[chain], positions=f"{chain}:{numbers}",
                           max_mutations=len(sites))  # fmt: skip
    space, example = design_space(config)
    variants = np.repeat(space.parent[None, :], len(letters), 0)
    variants[:, sites] = letters
    scores = zero_shot(load_model(args.model).eval(), example, space, variants, torch.device("cpu"))
    print(
        f"{len(fitness)} variants; zero-shot joint delta_logp scored in {time.time() - start:.0f} s",
        flush=True,
    )
    results = {}
    for method in args.methods:
        runs = np.array([campaign(method, seed, variants, fitness, scores, space.parent, args)
                         for seed in range(args.seeds)])  # fmt: skip
        mean, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else 0 * runs[0]
        results[method] = {
            "best_fraction": [
                [round(float(m), 3), round(float(s), 3)] for m, s in zip(mean[:, 0], se[:, 0], strict=True)
            ],
            "top1_found": [
                [round(float(m), 3), round(float(s), 3)] for m, s in zip(mean[:, 1], se[:, 1], strict=True)
            ],
        }
        print(f"{method}: best fraction {results[method]['best_fraction'][-1]}, top 1% found "
              f"{results[method]['top1_found'][-1]} ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
    measured = [args.initial + r * args.batch for r in range(args.rounds + 1)]
    print(json.dumps({"measured": measured, "first_round": args.first_round, "methods": results}))


if __name__ == "__main__":
    main()
