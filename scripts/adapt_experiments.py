"""The measurements behind `python -m dpo_inv adapt` (docs/adapt.md): one stability domain plays a user's own
protein. For N labelled single mutants drawn at random from it, the Spearman correlation with the measured
stability on that domain's remaining mutants of

- `zero_shot`: the starting model's `delta_logp`;
- `ridge`: ridge regression on one-hot sequences; `augmented`: one-hot plus the starting model's score
  (Hsu et al. 2022), penalty chosen by inner cross-validation;
- `adapt`: the model `dpo-inv adapt` ships (grid chosen by its grouped cross-validation, or the starting
  model when it keeps that);
- `adapt_ridge`: the augmented ridge model on the adapted model's score;
- `final_ridge`: the same as `dpo-inv adapt` ships it (`augmented_ridge.json`) and `dpo-inv score --ridge`
  applies it, on the adapted model's score in adapt's order (left to right): fitted on each labelled
  variant's cross-fitted score (from the fold model that did not train on it);
- `final_ridge_in_sample`: the same, fitted on the adapted model's own scores of the labels it trained on
  (what adapt shipped before the cross-fitting).

Other scores on the remaining mutants use `dpo-inv score`'s estimator and default order (conditional,
random).

    python scripts/adapt_experiments.py --output outputs/adapt_experiments.jsonl   # runs, appends
    python scripts/adapt_experiments.py --output outputs/adapt_experiments.jsonl --summary

`--scans ../shared/function/*.csv` does the same on ProteinGym scans (`DMS_score`; the structure from the
`reference.csv` beside them), each scan one protein. Each (domain, N, seed) is one line of the output; a
line already there is not run again. `--shard I/K`
runs every K-th domain from the I-th, so K processes can share the domains.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dpo_inv.data.dataset import VARIANTS, RecordSet, load_records
from dpo_inv.data.proteingym import from_reference
from dpo_inv.models.variants import spearman, variant_labels
from dpo_inv.models.weights import load_model
from dpo_inv.tools.adapt import AdaptOptions, choose_and_train, fit_augmented_ridge, variant_sets
from dpo_inv.tools.ridge import augmented_features, fit_ridge_cv, one_hot

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("zero_shot", "ridge", "augmented", "adapt", "adapt_ridge", "final_ridge", "final_ridge_in_sample")


def domain_records(path: Path, domain: str) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if f'"{domain}"' in line]
    return [
        {**r, "pdb_file": str((path.parent / r["pdb_file"]).resolve())}
        for r in records
        if r["domain"] == domain
    ]


def domain_data(domain: str, args: argparse.Namespace) -> tuple[RecordSet, np.ndarray]:
    """A stability domain's variants and labels (-ddG)."""
    records = domain_records(args.data, domain)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{domain}.jsonl"
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
        return load_records(file, args.cache_dir, kind=VARIANTS), np.array([r["score"] for r in records])


def scan_data(scan: Path, args: argparse.Namespace) -> tuple[RecordSet, np.ndarray]:
    """A ProteinGym scan's variants and DMS_score, its structure from the reference.csv beside it."""
    given = from_reference(scan.parent / "reference.csv", scan, "sequence")
    labels = np.array(variant_labels(str(scan), "DMS_score", False, "records", given))
    return load_records(str(scan), args.cache_dir, kind=VARIANTS, given=given), labels


def run_domain(domain: str, args: argparse.Namespace, done: set, output) -> None:
    data, labels = scan_data(Path(domain), args) if args.scans else domain_data(domain, args)
    domain = Path(domain).stem if args.scans else domain
    model = load_model(args.model)
    config = AdaptOptions(**({"max_steps": args.max_steps} if args.max_steps else {}))
    (full,) = variant_sets(model, data, labels, config, torch.device("cpu"))
    (evaluation,) = variant_sets(
        model, data, labels, replace(config, decoding_order="random"), torch.device("cpu")
    )
    tokens = full.variants  # records in file order: one structure, one wild type
    base = evaluation.reference.numpy()
    for n in args.sizes:
        for seed in args.seeds:
            if (domain, n, seed) in done:
                continue
            start = time.time()
            rows = np.random.default_rng(seed).permutation(len(labels))
            train, test = rows[:n], rows[n:]
            result = choose_and_train(model, [full.subset(train)], config)
            seconds = time.time() - start
            labelled = full.subset(train)
            shipped = fit_augmented_ridge(result.model, [labelled], result.out_of_fold, data, config)
            with torch.no_grad():
                adapted = evaluation.deltas(result.model).numpy()
                in_order = full.deltas(result.model).numpy()
                fitted = [labelled.deltas(result.model).cpu().numpy()]
            in_sample = fit_augmented_ridge(result.model, [labelled], fitted, data, config)
            ridge = fit_ridge_cv(one_hot(tokens[train]), labels[train], seed=seed)
            scores = {
                "zero_shot": base,
                "ridge": ridge.predict(one_hot(tokens)),
                "adapt": adapted,
                "final_ridge": shipped.predict(next(iter(shipped.proteins)), tokens, in_order),
                "final_ridge_in_sample": in_sample.predict(next(iter(in_sample.proteins)), tokens, in_order),
            }
            for name, score in (("augmented", base), ("adapt_ridge", adapted)):
                features = augmented_features(tokens, score)
                scores[name] = fit_ridge_cv(features[train], labels[train], 1, seed).predict(features)
            line = {
                "domain": domain,
                "n": n,
                "seed": seed,
                "length": len(full.wildtype),
                "test": len(test),
                **{name: spearman(scores[name][test], labels[test]) for name in METHODS},
                "decision": result.decision,
                "max_steps": result.best.max_steps,
                "learning_rate": result.best.learning_rate,
                "cv_adapt": result.best.spearman,
                "cv_start": result.start_mean,
                "cv_augmented": result.ridge_mean,
                "adapt_seconds": round(seconds, 1),
            }
            output.write(json.dumps(line) + "\n")
            output.flush()
            print(
                json.dumps({k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in line.items()}),
                flush=True,
            )


def summary(path: Path) -> None:
    """The table of docs/adapt.md: per N, each method's mean Spearman over domains and draws, ± the standard
    deviation of the per-draw means (over seeds); then adapt − augmented per domain, its mean ± standard
    deviation over domains, and how often adapt ranks better."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    print(
        "| N | domains x draws | "
        + " | ".join(METHODS)
        + " | adapt − augmented (± over domains) | adapt better |"
    )
    print("|---" * (len(METHODS) + 4) + "|")
    for n in sorted({line["n"] for line in lines}):
        rows = [line for line in lines if line["n"] == n]
        domains = sorted({r["domain"] for r in rows})
        seeds = sorted({r["seed"] for r in rows})
        cells = []
        for name in METHODS:
            per_seed = [np.mean([r[name] for r in rows if r["seed"] == s]) for s in seeds]
            cells.append(f"{np.mean([r[name] for r in rows]):.3f} ± {np.std(per_seed):.3f}")
        gain = [np.mean([r["adapt"] - r["augmented"] for r in rows if r["domain"] == d]) for d in domains]
        better = np.mean([r["adapt"] > r["augmented"] for r in rows])
        print(
            f"| {n} | {len(domains)} x {len(rows) / len(domains):.3g} | "
            + " | ".join(cells)
            + f" | {np.mean(gain):+.3f} ± {np.std(gain):.3f} | {better:.0%} |"
        )
    kept = {
        n: np.mean([r["decision"] != "adapted" for r in lines if r["n"] == n])
        for n in sorted({r["n"] for r in lines})
    }
    for n in kept:  # what the shipped ridge adds to the adapted model
        rows = [r for r in lines if r["n"] == n]
        gain = [np.mean([r["final_ridge"] - r["adapt"] for r in rows if r["domain"] == d])
                for d in sorted({r["domain"] for r in rows})]  # fmt: skip
        better = np.mean([r["final_ridge"] > r["adapt"] for r in rows])
        print(f"N={n}: final_ridge - adapt {np.mean(gain):+.3f} ± {np.std(gain):.3f} over domains, "
              f"better in {better:.0%} of the runs")  # fmt: skip
    seconds = {n: np.median([r["adapt_seconds"] for r in lines if r["n"] == n]) for n in kept}
    print("starting model kept: " + ", ".join(f"N={n} {v:.0%}" for n, v in kept.items()))
    print("median seconds of choose-and-train: " + ", ".join(f"N={n} {v:.0f}" for n, v in seconds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "stability" / "train.jsonl")
    parser.add_argument(
        "--domains", default=None, help="Comma-separated; default: the first 20 of every third by name."
    )
    parser.add_argument(
        "--scans",
        nargs="+",
        type=Path,
        help="ProteinGym scan files (reference.csv beside them) instead of --data",
    )
    parser.add_argument("--sizes", default="24,48,96,192")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--model", default="vanilla/v_48_020")
    parser.add_argument("--max_steps", default=None, help="adapt's grid of lengths; default adapt's own.")
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--shard", default="0/1", help="I/K: every K-th domain from the I-th.")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--summary", action="store_true", help="Print the table of the output and stop.")
    args = parser.parse_args()
    if args.summary:
        summary(args.output)
        return
    args.sizes = [int(n) for n in args.sizes.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.max_steps = [int(s) for s in args.max_steps.split(",")] if args.max_steps else None
    if args.scans:
        domains = [str(scan) for scan in args.scans]
    elif args.domains:
        domains = args.domains.split(",")
    else:
        all_domains = sorted({json.loads(line)["domain"] for line in args.data.read_text().splitlines()})
        domains = all_domains[::3][:20]
    index, count = (int(x) for x in args.shard.split("/"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // count))
    domains = domains[index::count]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.output.is_file():
        done = {
            (r["domain"], r["n"], r["seed"]) for r in map(json.loads, args.output.read_text().splitlines())
        }
    with args.output.open("a") as output:
        for domain in domains:
            run_domain(domain, args, done, output)


if __name__ == "__main__":
    main()
