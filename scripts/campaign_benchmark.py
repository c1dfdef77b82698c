"""Simulated design campaigns on a combinatorially complete landscape or on single-mutant scans, against the
field's baselines.

    python scripts/campaign_benchmark.py --landscape ../shared/campaign/trpb --initial 96 --rounds 4 \\
        --batch 96 --seeds 10 [--first_round zero_shot]
    python scripts/campaign_benchmark.py --scan ../shared/function/CALM1_HUMAN_Weile_2017.csv \\
        --initial 24 --rounds 3 --batch 24 --seeds 10
    python scripts/campaign_benchmark.py --scan ../shared/stability/train.jsonl --value_field label ...

A landscape folder holds `landscape.json` (pdb_file, chain_id, wildtype_seq, site_indices) and
`variants.csv` (`variant`: the letters at the sites, in order; `fitness`). A scan is a ProteinGym CSV
(`mutant` or `mutated_sequence`, `DMS_score`; its structure from `--structure`, or from the `reference.csv`
beside it) or variant records with `pdb_file`, `sequence` and the value (one campaign per structure). The
oracle reveals only what was proposed; the candidates are the measured variants (combinations never
measured cannot be proposed). Each campaign measures `--initial` variants (at random; with
`--first_round zero_shot` as `propose` picks a first batch, three quarters covering the residues and a
quarter the zero-shot model's best; `zero_shot_top`: only its best), then `--rounds` batches of `--batch`.
The zero-shot score is `propose`'s (`vanilla/v_48_020` on single mutants, the four noise levels' joint
scores averaged on combinations), or the average over the `--model` models. Methods, in the same runs:

- dpo_inv: what `dpo-inv propose` does — adapt the model to the measurements (on scans; `--adapt` on a
  landscape too), then the ensemble ridge on one-hot, mutated-position, nearness, pair (a landscape) or
  amino-acid count (a scan) and model-score features (zero-shot, and the adapted model's: cross-fitted on
  the measured variants), Thompson sampling;
- augmented_ridge: the same ensemble and batch rule on one-hot and zero-shot features (MLDE-style);
- greedy_zero_shot: the zero-shot joint score's best not yet measured;
- random.

Printed last, one JSON line: per method and round, the mean and standard error over seeds (and scans) of the
best value found over the best there is (`best_fraction`; on scans, whose values may be negative, the
fraction of variants no better than the best found) and of the fraction of the top 1% found (`top1_found`);
for the methods that predict, per round after the first, of the fraction of the batch that came back within
predicted ± uncertainty (`within_uncertainty`).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from dpo_inv.data.batches import collate
from dpo_inv.data.measurements import Measurement, read_measurements
from dpo_inv.data.records import read_records
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.variants import spearman
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.acquisition import choose_batch, top_batch, zero_shot_batch
from dpo_inv.tools.adapt import AdaptOptions, VariantSet, choose_and_train, variant_set
from dpo_inv.tools.design_space import read_design_space
from dpo_inv.tools.propose import ADAPTED_ORDERS, default_models, example_ca, measured_variants, zero_shot

METHODS = ("dpo_inv", "augmented_ridge", "greedy_zero_shot", "random")
CPU = torch.device("cpu")


@dataclass
class Problem:
    """One protein's variants, their values (the oracle), the zero-shot scores and what adapting needs."""

    name: str
    variants: np.ndarray  # [N, L] tokens
    values: np.ndarray  # [N] higher = better
    scores: np.ndarray  # [N] zero-shot joint delta_logp (the models' mean)
    parent: np.ndarray  # [L]
    model: ProteinMPNN  # the one adapted
    train_set: Callable[[np.ndarray], VariantSet] | None  # the measured rows' set (None: no adapting)
    predict: Callable[[ProteinMPNN], np.ndarray]  # every variant's delta_logp under a model
    fraction: str  # "ratio" (best found / the best there is) or "rank" (the share no better than it)
    ca: np.ndarray  # [L, 3] the residues' Cα coordinates (nearness features)


@cache
def loaded(name: str) -> ProteinMPNN:
    return load_model(name).eval()


def problem(name: str, structure: str, chain: str, rows: list, names: list[str] | None, adapt: bool,
            fraction: str) -> Problem:  # fmt: skip
    """The problem of measured ``rows`` (`Measurement`s) on ``structure``'s chain: the zero-shot score the
    mean of the joint scores of the models ``names`` (default: `propose`'s), the first the one adapted."""
    space, example = read_design_space(structure, [chain])
    variants, values = measured_variants(space, rows)
    models = [loaded(n) for n in names or default_models(variants, space.parent)]
    model = models[0]
    parent = torch.from_numpy(space.parent)
    batch = collate([{**example, "wildtype": parent}])
    if (variants != space.parent).sum(1).max() == 1:  # single mutants: the states of every one, once
        full = variant_set(model, batch, variants, values, None)
        others = [variant_set(m, batch, variants, values, None) for m in models[1:]]
        scores = np.mean([states.reference.numpy() for states in [full, *others]], 0)

        def predict(m: ProteinMPNN) -> np.ndarray:
            with torch.no_grad():
                return full.deltas(m).numpy().astype(np.float64)
    else:
        scores = np.mean([zero_shot(m, example, space, variants, CPU) for m in models], 0)

        def predict(m: ProteinMPNN) -> np.ndarray:
            return zero_shot(m, example, space, variants, CPU, ADAPTED_ORDERS)

    def train_set(rows: np.ndarray) -> VariantSet:
        return variant_set(model, batch, variants[rows], values[rows], None, max_orders=ADAPTED_ORDERS)

    ca = example_ca(example, len(space.parent))
    return Problem(name, variants, values, scores.astype(np.float64), space.parent, model,
                   train_set if adapt else None, predict, fraction, ca)  # fmt: skip


def landscape_problem(folder: Path, models: list[str] | None, adapt: bool) -> Problem:
    """A combinatorially complete landscape (`landscape.json` + `variants.csv`)."""
    landscape = json.loads((folder / "landscape.json").read_text())
    with open(folder / "variants.csv") as handle:
        table = list(csv.DictReader(handle))
    chain, sites = landscape["chain_id"], np.array(landscape["site_indices"])
    wildtype = np.array([ALPHABET.index(a) for a in landscape["wildtype_seq"]])
    numbers = [str(n) for n in landscape["site_numbers"]]
    rows = []
    for row in table:
        mutations = [
            f"{ALPHABET[wildtype[i]]}{n}{a}"
            for i, n, a in zip(sites, numbers, row["variant"], strict=True)
            if a != ALPHABET[wildtype[i]]
        ]
        rows.append(
            Measurement(":".join(mutations) or "WT", "mutations", float(row["fitness"]), "variants.csv")
        )
    return problem(folder.name, str(folder / landscape["pdb_file"]), chain, rows, models, adapt, "ratio")


def scan_problems(
    path: Path, args: argparse.Namespace, models: list[str] | None, adapt: bool
) -> list[Problem]:
    """One problem per structure of a scan: a ProteinGym CSV, or variant records with `pdb_file`."""
    if path.suffix == ".csv":
        structure, chain = args.structure, args.chain_id
        if structure is None:
            reference = {
                r.data["DMS_filename"]: r.data for r in read_records(str(path.parent / "reference.csv"))
            }
            entry = reference[path.name]
            structure, chain = str(path.parent / entry["pdb_file"]), entry.get("chain_id") or "A"
        rows = read_measurements(path, args.value_field)
        return [problem(path.stem, structure, chain, rows, models, adapt, "rank")]
    by_structure: dict[str, list] = {}
    for record in read_records(str(path)):
        by_structure.setdefault(record.data["pdb_file"], []).append(record)
    problems = []
    for pdb_file, records in sorted(by_structure.items()):
        rows = [Measurement(r.data["sequence"], "sequence", float(r.data[args.value_field or "label"]),
                            r.location) for r in records]  # fmt: skip
        chain = records[0].data.get("chain_id", "A")
        problems.append(problem(Path(pdb_file).name.split(".")[0], str(path.parent / pdb_file), chain, rows,
                                models, adapt, "rank"))  # fmt: skip
    return problems


def campaign(
    method: str, seed: int, p: Problem, args: argparse.Namespace
) -> list[tuple[float, float, float]]:
    """One campaign: (best fraction, top-1% fraction found, fraction of the batch just measured that came
    back within predicted ± uncertainty: NaN where nothing predicted it) after the first batch and after
    each round."""
    rng = np.random.default_rng(seed)
    values = p.values
    threshold = np.sort(values)[-max(1, round(0.01 * len(values)))]
    top = set(np.flatnonzero(values >= threshold).tolist())  # the top 1%, and any tied with its last
    if args.first_round == "random":
        measured = list(rng.choice(len(values), args.initial, replace=False))
    elif args.first_round == "zero_shot":
        measured = list(zero_shot_batch(p.variants, p.scores, p.parent, args.initial)[0])
    else:
        measured = list(top_batch(p.scores, args.initial))
    history = []
    within = np.nan
    for round_ in range(args.rounds + 1):
        best = max(measured, key=lambda i: values[i])
        found = values[best] / values.max() if p.fraction == "ratio" else np.mean(values <= values[best])
        history.append((found, len(top & set(measured)) / len(top), within))
        if round_ == args.rounds:
            break
        left = np.setdiff1d(np.arange(len(values)), measured)
        known = np.array(measured)
        if method == "random":
            picked = rng.choice(left, args.batch, replace=False)
        elif method == "greedy_zero_shot":
            picked = left[top_batch(p.scores[left], args.batch)]
        else:
            scores, known_scores = p.scores, p.scores[known]
            if method == "dpo_inv" and p.train_set is not None and len(known) >= AdaptOptions.min_labels:
                config = AdaptOptions(decoding_order="left_to_right", seed=seed)
                adapted = choose_and_train(p.model, [p.train_set(known)], config)
                if adapted.decision == "adapted":
                    scores = np.c_[scores, p.predict(adapted.model)]
                    known_scores = np.c_[known_scores, adapted.out_of_fold[0]]
            draw = seed * 100 + round_
            rule = args.acquisition if method == "dpo_inv" else "thompson"
            chosen, mean, uncertainty = choose_batch(
                p.variants[known], values[known], known_scores, p.variants[left], scores[left], p.parent,
                args.batch, rule, fit_seed=draw, draw_seed=draw, pairwise=method == "dpo_inv",
                positional=method == "dpo_inv", ca=p.ca if method == "dpo_inv" else None,
                members=args.members if method == "dpo_inv" else 10, substituted=method == "dpo_inv",
            )  # fmt: skip
            picked = left[chosen]
            within = float(np.mean(np.abs(values[picked] - mean[chosen]) <= uncertainty[chosen]))
        measured += list(picked)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--landscape", type=Path)
    where.add_argument("--scan", type=Path)
    parser.add_argument("--structure", help="The scan's structure (default: from reference.csv beside it).")
    parser.add_argument("--chain_id", default="A")
    parser.add_argument("--value_field", help="The scan's value column (default: DMS_score or value).")
    parser.add_argument(
        "--adapt",
        action=argparse.BooleanOptionalAction,
        help="Whether dpo_inv adapts the model (default: on scans, not on a landscape).",
    )
    parser.add_argument("--acquisition", choices=("thompson", "ucb", "greedy"), default="thompson",
                        help="dpo_inv's batch rule.")  # fmt: skip
    parser.add_argument(
        "--members", type=int, default=10, help="dpo_inv's ensemble members (propose's --members)."
    )
    parser.add_argument(
        "--model",
        nargs="+",
        help="Models whose joint scores are averaged as the zero-shot score; the first is adapted (default: "
        "propose's: vanilla/v_48_020 on single mutants, the four noise levels on combinations).",
    )
    parser.add_argument("--initial", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--first_round",
        choices=("random", "zero_shot", "zero_shot_top"),
        default="random",
        help="zero_shot: as propose picks a first batch; zero_shot_top: the zero-shot score's best.",
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    if args.landscape:
        problems = [landscape_problem(args.landscape, args.model, bool(args.adapt))]
    else:
        problems = scan_problems(args.scan, args, args.model, args.adapt is not False)
    ranked = np.nanmean([spearman(p.scores, p.values) for p in problems])
    print(f"{len(problems)} proteins, {sum(len(p.values) for p in problems)} variants; zero-shot scored in "
          f"{time.time() - start:.0f} s, its Spearman with the values {ranked:.3f} (mean over proteins)",
          flush=True)  # fmt: skip
    results = {}
    for method in args.methods:
        runs = np.array([campaign(method, seed, p, args) for p in problems for seed in range(args.seeds)])
        mean, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else 0 * runs[0]
        table = [[[round(float(m), 3), round(float(s), 3)] for m, s in zip(mean[:, k], se[:, k], strict=True)]
                 for k in range(3)]  # fmt: skip
        results[method] = {"best_fraction": table[0], "top1_found": table[1]}
        if not np.isnan(runs[:, 1:, 2]).any():  # the methods that predict: each round's batch
            results[method]["within_uncertainty"] = table[2][1:]
        print(f"{method}: best fraction {results[method]['best_fraction'][-1]}, top 1% found "
              f"{results[method]['top1_found'][-1]} ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
    measured = [args.initial + r * args.batch for r in range(args.rounds + 1)]
    print(json.dumps({"measured": measured, "first_round": args.first_round, "methods": results}))


if __name__ == "__main__":
    main()
