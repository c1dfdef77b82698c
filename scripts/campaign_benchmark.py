"""Simulated design campaigns on a combinatorially complete landscape or on single-mutant scans, against the
field's baselines; `propose`'s own round function picks dpo_inv's batches, a simulated lab measures them.

    python scripts/campaign_benchmark.py --landscape ../shared/campaign/trpb --initial 96 --rounds 4 \\
        --batch 96 --seeds 10 [--first_round zero_shot]
    python scripts/campaign_benchmark.py --landscape ../shared/campaign/trpb --prior_spearman 0.05 ...
    python scripts/campaign_benchmark.py --landscape ../shared/campaign/trpb --synthetic 1 \\
        --prior_spearman 0.2 ...
    python scripts/campaign_benchmark.py --scan ../shared/function/CALM1_HUMAN_Weile_2017.csv \\
        --initial 24 --rounds 3 --batch 24 --seeds 10
    python scripts/campaign_benchmark.py --scan ../shared/stability/train.jsonl --score_field label ...

A landscape folder holds `landscape.json` (pdb_file, chain_id, wildtype_seq, site_indices, site_numbers)
and `variants.csv` (`variant`: the letters at the sites, in order; `fitness`). A scan is a ProteinGym CSV
(`mutant` or `mutated_sequence`, `DMS_score`; its structure from `--structure`, or from the `reference.csv`
beside it) or variant records with `pdb_file`, `sequence` and the value (one campaign per structure). The
oracle reveals only what was proposed; the candidates are the measured variants (combinations never
measured cannot be proposed). Each campaign measures `--initial` variants (at random, the published
protocol; with `--first_round zero_shot` the batch `propose` picks before any measurement, seeded by the
campaign's seed), then `--rounds` batches of `--batch`. The zero-shot score is `propose`'s
(`vanilla/v_48_020` on single mutants, the four noise levels' joint scores averaged on combinations), or the
average over the `--model` models; a landscape's is kept in `--cache` (default outputs/campaign_benchmark/).

Robustness, without new measurements:
- `--prior_spearman X`: the zero-shot score mixed (seeded by `--prior_seed`) with noise, or with the values'
  ranks where X is above its own Spearman, until its Spearman with the values over all variants is X;
- `--synthetic K`: `--synthetic_count` NK landscapes (seeds 0, 1, ...) on the landscape's sites instead of
  its values: each site's contribution depends on its residue and K other sites' (random tables), the
  fitness the squared excess of their sum over its 90th percentile, scaled so that the best is 1.

Methods, in the same runs:
- dpo_inv: `propose`'s round function (`dpo_inv.campaign.round.next_batch`) with `propose`'s defaults:
  adapting where every measured variant is a single mutant (`--adapt`/`--no-adapt` force it), the ensemble
  and its batch rule (on a library of few positions with a share far from the best measured:
  `--far_share`);
- augmented_ridge: the same ensemble of ridge fits and Thompson sampling on one-hot and zero-shot features
  only (MLDE-style);
- greedy_zero_shot: the zero-shot joint score's best not yet measured;
- random.

Printed last, one JSON line: per method and round, the mean and standard error over seeds (and proteins) of
the best value found over the best there is (`best_fraction`; on scans, whose values may be negative, the
fraction of variants no better than the best found) and of the fraction of the top 1% found (`top1_found`);
for the methods that predict, per round after the first, of the fraction of the batch that came back within
predicted ± uncertainty (`within_uncertainty`).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import multiprocessing
import time
from dataclasses import dataclass, replace
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from dpo_inv.campaign import acquisition, exploring
from dpo_inv.campaign.acquisition import top_batch
from dpo_inv.campaign.batch import choose_batch
from dpo_inv.campaign.config import NOISE_LEVELS
from dpo_inv.campaign.history import variant_tokens
from dpo_inv.campaign.predictors import DEFAULT_FAMILIES, FAMILIES
from dpo_inv.campaign.propose import default_models
from dpo_inv.campaign.round import CampaignState, RoundSettings, next_batch
from dpo_inv.campaign.scoring import ModelScorer, example_ca
from dpo_inv.data.design import read_design_space, variant_keys
from dpo_inv.data.measurements import Measurement, read_measurements
from dpo_inv.data.records import read_records
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.variants import spearman
from dpo_inv.models.weights import load_model

METHODS = ("dpo_inv", "augmented_ridge", "greedy_zero_shot", "random")
CPU = torch.device("cpu")


@dataclass
class Problem:
    """One protein's variants, their values (the oracle), the zero-shot scores and the scorer."""

    name: str
    variants: np.ndarray  # [N, L] tokens
    values: np.ndarray  # [N] higher = better
    scores: np.ndarray  # [N] zero-shot joint delta_logp (the models' mean)
    parent: np.ndarray  # [L]
    scorer: ModelScorer
    fraction: str  # "ratio" (best found / the best there is) or "rank" (the share no better than it)
    ca: np.ndarray  # [L, 3] the residues' Cα coordinates (nearness features)


@cache
def loaded(name: str) -> ProteinMPNN:
    return load_model(name).eval()


def problem(name: str, structure: str, chain: str, rows: list[Measurement], names: list[str] | None,
            fraction: str, cache_file: Path | None = None) -> Problem:  # fmt: skip
    """The problem of measured ``rows`` on ``structure``'s chain: the zero-shot score the mean of the joint
    scores of the models ``names`` (default: `propose`'s); ``cache_file`` keeps the scores."""
    space, example = read_design_space(structure, [chain])
    rows = [row for row in rows if np.isfinite(row.value)]
    variants = np.array([variant_tokens(space, row) for row in rows], dtype=np.uint8)
    values = np.array([row.value for row in rows])
    names = names or default_models(variants, space.parent)
    scorer = ModelScorer([loaded(n) for n in names], example, space, CPU)
    if cache_file is not None and cache_file.exists():
        scores = np.load(cache_file)
    else:
        scores = scorer.zero_shot(variants)
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            np.save(cache_file, scores)
    scorer.known = dict(zip(variant_keys(variants), scores.tolist(), strict=True))
    ca = example_ca(example, len(space.parent))
    return Problem(name, variants, values, scores, space.parent, scorer, fraction, ca)


def landscape_problem(folder: Path, models: list[str] | None, cache_dir: Path) -> Problem:
    """A combinatorially complete landscape (`landscape.json` + `variants.csv`)."""
    landscape = json.loads((folder / "landscape.json").read_text())
    with open(folder / "variants.csv") as handle:
        table = list(csv.DictReader(handle))
    sites = np.array(landscape["site_indices"])
    wildtype = [landscape["wildtype_seq"][i] for i in sites]
    numbers = [str(n) for n in landscape["site_numbers"]]
    rows = []
    for row in table:
        mutations = [
            f"{w}{n}{a}" for w, n, a in zip(wildtype, numbers, row["variant"], strict=True) if a != w
        ]
        rows.append(
            Measurement(":".join(mutations) or "WT", "mutations", float(row["fitness"]), "variants.csv")
        )
    key = hashlib.sha1(" ".join(models or NOISE_LEVELS).encode()).hexdigest()[:8]
    cache_file = cache_dir / f"{folder.name}-{key}.npy"
    return problem(folder.name, str(folder / landscape["pdb_file"]), landscape["chain_id"], rows, models,
                   "ratio", cache_file)  # fmt: skip


def scan_problems(path: Path, args: argparse.Namespace) -> list[Problem]:
    """One problem per structure of a scan: a ProteinGym CSV, or variant records with `pdb_file`."""
    if path.suffix == ".csv":
        structure, chain = args.structure, args.chain_id
        if structure is None:
            reference = {
                r.data["DMS_filename"]: r.data for r in read_records(str(path.parent / "reference.csv"))
            }
            entry = reference[path.name]
            structure, chain = str(path.parent / entry["pdb_file"]), entry.get("chain_id") or "A"
        rows = read_measurements(path, args.score_field)
        return [problem(path.stem, structure, chain, rows, args.model, "rank")]
    by_structure: dict[str, list] = {}
    for record in read_records(str(path)):
        by_structure.setdefault(record.data["pdb_file"], []).append(record)
    problems = []
    for pdb_file, records in sorted(by_structure.items()):
        rows = [Measurement(r.data["sequence"], "sequence", float(r.data[args.score_field or "label"]),
                            r.location) for r in records]  # fmt: skip
        chain = records[0].data.get("chain_id", "A")
        problems.append(problem(Path(pdb_file).name.split(".")[0], str(path.parent / pdb_file), chain, rows,
                                args.model, "rank"))  # fmt: skip
    return problems


def sites_only(p: Problem) -> Problem:
    """``p`` on the positions its variants vary alone (the same campaigns, faster): for a landscape whose
    scores are all known and whose model is not adapted."""
    sites = np.flatnonzero((p.variants != p.parent).any(0))
    variants = np.ascontiguousarray(p.variants[:, sites])
    scorer = replace(p.scorer, known=dict(zip(variant_keys(variants), p.scores.tolist(), strict=True)))
    return replace(p, variants=variants, parent=p.parent[sites], ca=p.ca[sites], scorer=scorer)


def standard_ranks(x: np.ndarray) -> np.ndarray:
    r = np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)
    return (r - r.mean()) / r.std()


def with_prior_spearman(p: Problem, target: float, seed: int) -> Problem:
    """``p`` with its zero-shot score mixed with noise (or with the values' ranks, where ``target`` is above
    its Spearman) until its Spearman with the values is ``target``."""
    z, truth = standard_ranks(p.scores), standard_ranks(p.values)
    current = spearman(z, p.values)
    other = np.random.default_rng(seed).standard_normal(len(z)) if target < current else truth

    def beyond(weight: float) -> bool:  # still on the model's side of the target
        return (spearman(z + weight * other, p.values) - target) * (current - target) > 0

    low, high = 0.0, 1.0
    while beyond(high) and high < 1e6:
        high *= 2
    for _ in range(30):  # bisection on the weight of the part mixed in
        low, high = ((low + high) / 2, high) if beyond((low + high) / 2) else (low, (low + high) / 2)
    scores = z + (low + high) / 2 * other
    scorer = replace(p.scorer, known=dict(zip(variant_keys(p.variants), scores.tolist(), strict=True)))
    return replace(p, scores=scores, scorer=scorer)


def nk_landscape(p: Problem, k: int, seed: int) -> Problem:
    """``p`` with NK values on its varied sites: site i's contribution a random table of its residue and
    those of K other sites; the fitness the squared excess of the summed contribution over its 90th
    percentile, scaled to a best of 1 (nine in ten variants dead, a few near the best: as on TrpB, where 92%
    are below 0.05)."""
    rng = np.random.default_rng(seed)
    sites = np.flatnonzero((p.variants != p.parent).any(0))
    tokens = p.variants[:, sites].astype(np.int64)
    raw = np.zeros(len(tokens))
    for i in range(len(sites)):
        others = rng.choice(np.delete(np.arange(len(sites)), i), size=k, replace=False)
        table = rng.uniform(size=(21,) * (k + 1))
        raw += table[tuple(tokens[:, j] for j in (i, *others))]
    values = np.clip(raw - np.quantile(raw, 0.9), 0, None) ** 2
    return replace(p, name=f"{p.name}-NK{k}-{seed}", values=values / values.max())


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
    index = dict(zip(variant_keys(p.variants), range(len(p.variants)), strict=True))
    adapt = {None: "auto", True: "yes", False: "no"}[args.adapt]
    settings = RoundSettings(args.batch, args.acquisition, args.members, adapt, seed, tuple(args.predictor))
    nothing = np.zeros((0, len(p.parent)), np.uint8)
    if args.first_round == "random":
        measured = list(rng.choice(len(values), args.initial, replace=False))
    else:
        state = CampaignState(p.parent, p.variants, nothing, np.zeros(0), nothing, p.ca)
        first = next_batch(state, p.scorer, replace(settings, num_proposals=args.initial))
        measured = [index[k] for k in variant_keys(first.variants)]
    history = []
    within = np.nan
    for round_ in range(args.rounds + 1):
        best = max(measured, key=lambda i: values[i])
        found = values[best] / values.max() if p.fraction == "ratio" else np.mean(values <= values[best])
        history.append((found, len(top & set(measured)) / len(top), within))
        if round_ == args.rounds:
            break
        known = np.array(measured)
        if method == "dpo_inv":
            state = CampaignState(p.parent, p.variants, p.variants[known], values[known], nothing, p.ca)
            batch = next_batch(state, p.scorer, settings)
            picked = np.array([index[k] for k in variant_keys(batch.variants)])
            within = float(np.mean(np.abs(values[picked] - batch.predicted) <= batch.uncertainty))
        else:
            left = np.setdiff1d(np.arange(len(values)), known)
            if method == "random":
                picked = rng.choice(left, args.batch, replace=False)
            elif method == "greedy_zero_shot":
                picked = left[top_batch(p.scores[left], args.batch)]
            else:  # augmented ridge
                draw = seed + len(known)
                choice = choose_batch(
                    p.variants[known], values[known], p.scores[known], p.variants[left], p.scores[left],
                    p.parent, args.batch, "thompson", fit_seed=draw, draw_seed=draw, pairwise=False,
                    positional=False, substituted=False,
                )  # fmt: skip
                picked = left[choice.picked]
                error = np.abs(values[picked] - choice.mean[choice.picked])
                within = float(np.mean(error <= choice.uncertainty[choice.picked]))
        measured += list(picked)
    return history


SUITE_PROTOCOLS = {3: (24, 4, 24), 4: (96, 4, 96)}  # sites: (first batch, rounds, batch) of the suite


def suite_protocol(p: Problem) -> tuple[int, int, int]:
    """The suite's protocol for a landscape of ``p``'s sites: 24 + 4 x 24 on three, 96 + 4 x 96 on four."""
    sites = int((p.variants != p.parent).any(0).sum())
    return SUITE_PROTOCOLS[min(max(sites, 3), 4)]


def landscape_problems(folder: Path, args: argparse.Namespace) -> list[Problem]:
    """The problems of one landscape folder, with the robustness settings applied."""
    problems = [landscape_problem(folder, args.model, args.cache)]
    return robust(problems if args.adapt else [sites_only(p) for p in problems], args)


def robust(problems: list[Problem], args: argparse.Namespace) -> list[Problem]:
    """``problems`` as `--synthetic` and `--prior_spearman` ask."""
    if args.synthetic is not None:
        problems = [nk_landscape(p, args.synthetic, s) for p in problems for s in range(args.synthetic_count)]
    if args.prior_spearman is not None:
        problems = [with_prior_spearman(p, args.prior_spearman, args.prior_seed) for p in problems]
    return problems


PROBLEMS: list[Problem] = []  # the problems the worker processes run campaigns on (inherited by fork)


def run_one(task: tuple[str, int, int, argparse.Namespace]) -> list[tuple[float, float, float]]:
    method, seed, index, args = task
    return campaign(method, seed, PROBLEMS[index], args)


def one_thread() -> None:
    """A worker's numerical libraries on one thread: ``--jobs`` processes, each with a BLAS thread per core,
    would hold more threads than cores (12 times slower on two)."""
    threadpool_limits(1)


def run_methods(problems: list[Problem], args: argparse.Namespace, start: float) -> dict:
    """Every method's campaigns on ``problems`` over the seeds (``args.jobs`` processes, one thread each):
    per method, the mean and standard error of each round's best fraction, top 1% found and (methods that
    predict) share within the uncertainty."""
    PROBLEMS[:] = problems
    tasks = [
        (m, seed, i, args) for m in args.methods for i in range(len(problems)) for seed in range(args.seeds)
    ]
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs, one_thread) as pool:
            runs_of = pool.map(run_one, tasks, chunksize=1)
    else:
        runs_of = [run_one(task) for task in tasks]
    results = {}
    for method in args.methods:
        runs = np.array([r for task, r in zip(tasks, runs_of, strict=True) if task[0] == method])
        mean, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else 0 * runs[0]
        table = [[[round(float(m), 3), round(float(s), 3)] for m, s in zip(mean[:, k], se[:, k], strict=True)]
                 for k in range(3)]  # fmt: skip
        results[method] = {"best_fraction": table[0], "top1_found": table[1]}
        if not np.isnan(runs[:, 1:, 2]).any():  # the methods that predict: each round's batch
            results[method]["within_uncertainty"] = table[2][1:]
        print(f"{method}: best fraction {results[method]['best_fraction'][-1]}, top 1% found "
              f"{results[method]['top1_found'][-1]} ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
    return results


def table_row(name: str, first_round: str, measured: int, results: dict) -> str:
    """One markdown row of the suite: best found ± s.e. and top 1% found, per method."""
    cells = []
    for method in METHODS:
        if method in results:
            (best, se), (top, _) = results[method]["best_fraction"][-1], results[method]["top1_found"][-1]
            cells.append(f"{best:.3f} ± {se:.3f} / {100 * top:.1f}%")
        else:
            cells.append("")
    first = "`propose`'s" if first_round == "zero_shot" else "at random"
    return f"| {name} | {first} | {measured} | " + " | ".join(cells) + " |"


def suite(args: argparse.Namespace, start: float) -> None:
    """Every landscape of ``args.suite``, both first rounds, each with the protocol of its size; one table."""
    rows, everything = [], {}
    for folder in sorted(f for f in args.suite.iterdir() if (f / "landscape.json").exists()):
        problems = landscape_problems(folder, args)
        ranked = np.nanmean([spearman(p.scores, p.values) for p in problems])
        initial, rounds, batch = suite_protocol(problems[0])
        for first_round in ("zero_shot", "random"):
            run = argparse.Namespace(**{**vars(args), "initial": initial, "rounds": rounds, "batch": batch,
                                        "first_round": first_round})  # fmt: skip
            print(f"{folder.name} ({ranked:.2f}), first round {first_round}:", flush=True)
            results = run_methods(problems, run, start)
            everything[f"{folder.name}/{first_round}"] = results
            rows.append(
                table_row(f"{folder.name} ({ranked:.2f})", first_round, initial + rounds * batch, results)
            )
    print(
        "\n| landscape (zero-shot Spearman) | first round | measured | "
        + " | ".join(f"{m}: best / top 1%" for m in METHODS)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(METHODS))
    print("\n".join(rows))
    print(f"({time.time() - start:.0f} s)")
    print(json.dumps({"suite": everything}))


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    if args.first_at_random is not None:
        acquisition.FIRST_AT_RANDOM = args.first_at_random
    if args.far_share is not None:
        exploring.FAR_SHARE = args.far_share
    start = time.time()
    if args.suite:
        suite(args, start)
        return
    if args.landscape:
        problems = landscape_problems(args.landscape, args)
    else:
        problems = robust(scan_problems(args.scan, args), args)
    ranked = np.nanmean([spearman(p.scores, p.values) for p in problems])
    print(f"{len(problems)} proteins, {sum(len(p.values) for p in problems)} variants; zero-shot scored in "
          f"{time.time() - start:.0f} s, its Spearman with the values {ranked:.3f} (mean over proteins)",
          flush=True)  # fmt: skip
    results = run_methods(problems, args, start)
    measured = [args.initial + r * args.batch for r in range(args.rounds + 1)]
    print(json.dumps({"measured": measured, "first_round": args.first_round, "methods": results}))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--landscape", type=Path)
    where.add_argument("--scan", type=Path)
    where.add_argument(
        "--suite",
        type=Path,
        help="Every landscape folder in it, both first rounds, each with the protocol of its size (24 + 4 x "
        "24 on three sites, 96 + 4 x 96 on four).",
    )
    parser.add_argument("--structure", help="The scan's structure (default: from reference.csv beside it).")
    parser.add_argument("--chain_id", default="A")
    parser.add_argument(
        "--score_field",
        "--value_field",  # its former name
        help="The scan's value column, as propose's --score_field (default: DMS_score or value).",
    )
    parser.add_argument(
        "--adapt",
        action=argparse.BooleanOptionalAction,
        help="Whether dpo_inv adapts the model (default: propose's: where every measured variant is single).",
    )
    parser.add_argument("--acquisition", choices=("thompson", "ucb", "greedy"), default="thompson",
                        help="dpo_inv's batch rule.")  # fmt: skip
    parser.add_argument("--members", type=int, default=10, help="dpo_inv's ensemble members (propose's).")
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
    parser.add_argument("--first_round", choices=("random", "zero_shot"), default="random",
                        help="zero_shot: the batch propose picks before any measurement.")  # fmt: skip
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--first_at_random",
        type=float,
        help="The share of the first batch drawn at random (default: propose's).",
    )
    parser.add_argument("--far_share", type=float,
                        help="The share of a batch on a library given to candidates far from the best "
                        "measured (default: propose's).")  # fmt: skip
    parser.add_argument("--prior_spearman", type=float, help="The zero-shot score's Spearman, by mixing.")
    parser.add_argument("--prior_seed", type=int, default=0, help="The seed of --prior_spearman's noise.")
    parser.add_argument("--synthetic", type=int, metavar="K", help="NK landscapes of epistasis K instead.")
    parser.add_argument(
        "--synthetic_count", type=int, default=3, help="How many NK landscapes (seeds 0, 1, ...)."
    )
    parser.add_argument("--cache", type=Path, default=Path("outputs/campaign_benchmark"),
                        help="Where a landscape's zero-shot scores are kept.")  # fmt: skip
    parser.add_argument(
        "--predictor",
        nargs="+",
        choices=FAMILIES,
        default=list(DEFAULT_FAMILIES),
        help="The predictor families dpo_inv chooses among by cross-validation on a library of few positions "
        "(default: propose's, ridge and alive).",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="Campaigns run at once (processes, one thread each)."
    )
    args = parser.parse_args()
    if args.jobs < 1 or args.seeds < 1:
        parser.error("--jobs and --seeds: give a positive number")
    if args.suite and not args.suite.is_dir():
        parser.error(f"--suite {args.suite}: no such folder")
    if "trees" in args.predictor and find_spec("sklearn") is None:
        parser.error("--predictor trees needs scikit-learn: pip install -e '.[trees]'")
    return args


if __name__ == "__main__":
    main()
