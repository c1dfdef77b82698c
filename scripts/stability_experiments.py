"""The measurements behind docs/stability.md: alignment settings on the stability data, judged on domains
never trained on.

    python scripts/stability_experiments.py [--work_dir outputs/stability_experiments] [--only NAME ...]
        [--seeds 42 1 2]

The 77 domains are split by `scripts/split_by_domain.py` (homologues kept together) into 51 for training
and model choice and 26 held out for the test (seed 1); the 51 again into 40 that train and 11 whose
variants (300 per domain) pick the best eval (seed 2). Each run trains with `eval_on_start`, evaluates
every `eval_steps` on the 11 and keeps `best/` by `eval_spearman`; `best/` and `final/` are then scored on
300 variants per test domain (conditional, left to right), and `final/` also with the full-sequence
estimator on 40 per test domain, which gives the mean log p of the variants too; `scripts/design_ability.py`
measures the designs `best/` samples on 12 other backbones. `--seeds` repeats each run with those training
seeds (42, the trainer's default, names the run alone). One JSON line per run is appended to
`WORK_DIR/results.jsonl`. Each run takes 6-20 minutes on two CPU cores. Runs named `sft_then_...` first
fine-tune on the training domains' structures (SFT, docs/sft.md) and align that model.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from dpo_inv.data.records import rebase_paths, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
STABILITY = ROOT.parent / "shared" / "stability" / "train.jsonl"
PY = sys.executable

# name: (pairs, trainer options); pairs: (strategy, min_margin, pairs per domain, extra)
RUNS = {
    "best_vs_worst_random40": (("best_vs_worst", 1, 40, ""), "--decoding_order random --max_steps 200"),
    "best_vs_worst_extreme40": (("best_vs_worst", 1, 40, "extreme"),
                                "--decoding_order random --max_steps 200"),
    "best_vs_worst_extreme80_400steps": (("best_vs_worst", 1, 80, "extreme"),
                                         "--decoding_order random --max_steps 400 --eval_steps 100"),
    "best_vs_worst_random40_rpo1": (("best_vs_worst", 1, 40, ""),
                                    "--decoding_order random --max_steps 200 --rpo_alpha 1"),
    "same_position": (("same_position", 1, 100, ""), "--max_steps 200"),
    "same_position_beta1": (("same_position", 1, 100, ""), "--max_steps 200 --beta 1"),
    "same_position_lr2e-4": (("same_position", 1, 100, ""), "--max_steps 200 --learning_rate 2e-4"),
    "same_position_full_sequence": (("same_position", 1, 100, "full_sequence"),
                                    "--decoding_order random --max_steps 200"),
    "same_position_200_500steps": (("same_position", 1, 200, ""), "--max_steps 500 --eval_steps 100"),
    "same_position_200_400steps": (("same_position", 1, 200, ""), "--max_steps 400"),
    "same_position_200_400steps_anchor0.3": (("same_position", 1, 200, ""),
                                             "--max_steps 400 --anchor_weight 0.3"),
    "same_position_200_400steps_anchor0.1": (("same_position", 1, 200, ""),
                                             "--max_steps 400 --anchor_weight 0.1"),
    "sft_then_same_position_200_400steps_anchor0.1": (
        ("same_position", 1, 200, ""), "--max_steps 400 --anchor_weight 0.1 --model_name_or_path {sft}"),
}  # fmt: skip
# Supervised fine-tuning on the training domains' structures before DPO (runs whose options name {sft}): the
# setting of docs/sft.md, the best model by eval_loss on the choosing domains' structures.
SFT = (
    "--loss_type sft --max_steps 200 --learning_rate 3e-5 --warmup_steps 10 "
    "--per_device_train_batch_size 8 --eval_steps 20 --save_steps 20 --logging_steps 20 "
    "--eval_on_start true --report_to none"
)
TRAINING = ("--eval_split 0 --beta 0.1 --learning_rate 5e-5 --per_device_train_batch_size 8 --eval_steps 50 "
            "--eval_on_start --metric_for_best_model eval_spearman --save_steps 1000 --logging_steps 10 "
            "--decoding_order left_to_right --report_to none")  # fmt: skip


def run(*args: str) -> str:
    return subprocess.run([*args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def subsample(source: Path, target: Path, per_domain: int) -> None:
    rows = defaultdict(list)
    for line in source.read_text().splitlines():
        row = json.loads(line)
        rows[row["domain"]].append(row)
    rng = random.Random(0)
    picked = [row for domain in rows.values() for row in rng.sample(domain, min(per_domain, len(domain)))]
    write_jsonl(target, rebase_paths(picked, source.parent, target.parent))


def prepare(work: Path) -> None:
    if (work / "dev" / "eval300.jsonl").is_file():
        return
    split = str(ROOT / "scripts" / "split_by_domain.py")
    run(PY, split, str(STABILITY), "--output_dir", str(work / "split"), "--held_out", "0.33", "--seed", "1")
    run(PY, split, str(work / "split" / "train.jsonl"), "--output_dir", str(work / "dev"),
        "--held_out", "0.2", "--seed", "2")  # fmt: skip
    subsample(work / "split" / "held_out.jsonl", work / "test300.jsonl", 300)
    subsample(work / "split" / "held_out.jsonl", work / "test40.jsonl", 40)
    subsample(work / "dev" / "held_out.jsonl", work / "dev" / "eval300.jsonl", 300)


def build_pairs(work: Path, strategy: str, min_margin: float, per_domain: int, extra: str) -> Path:
    target = work / "pairs" / f"{strategy}_{min_margin}_{per_domain}{'_' + extra if extra else ''}.jsonl"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cap = [] if extra == "extreme" else ["--max_pairs_per_structure", str(per_domain)]
    run(PY, "-m", "dpo_inv", "pairs", str(work / "dev" / "train.jsonl"), "--output", str(target),
        "--strategy", strategy, "--min_margin", str(min_margin), *cap)  # fmt: skip
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    if extra == "extreme":  # the first pairs of best_vs_worst: the best against the worst, ...
        taken: dict[str, int] = defaultdict(int)
        rows = [r for r in rows if (taken.__setitem__(r["pdb_file"], taken[r["pdb_file"]] + 1)
                                    or taken[r["pdb_file"]] <= per_domain)]  # fmt: skip
    if extra == "full_sequence":  # score the whole sequences, not only the substituted position
        rows = [{k: v for k, v in r.items() if k != "mutable_positions"} for r in rows]
    target.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target


def structures(source: Path, target: Path) -> Path:
    """The structure records (each domain's native sequence) of the domains in ``source``."""
    files = {}
    for line in source.read_text().splitlines():
        row = json.loads(line)
        files.setdefault(row["pdb_file"], {"pdb_file": str((source.parent / row["pdb_file"]).resolve()),
                                           "chain_id": row["chain_id"]})  # fmt: skip
    write_jsonl(target, list(files.values()))
    return target


def sft(work: Path, seed: int) -> Path:
    """SFT on the training domains' structures (once per seed); its best model."""
    output = work / "runs" / f"sft_seed{seed}"
    if not (output / "best").is_dir():
        train = structures(work / "dev" / "train.jsonl", work / "dev" / "train_structures.jsonl")
        valid = structures(work / "dev" / "held_out.jsonl", work / "dev" / "held_out_structures.jsonl")
        shutil.rmtree(output, ignore_errors=True)
        run(PY, "-m", "dpo_inv.run", "--train_file", str(train), "--eval_file", str(valid), "--output_dir",
            str(output), "--seed", str(seed), *SFT.split())  # fmt: skip
    return output / "best"


def score(work: Path, model: Path, data: str, *options: str) -> tuple[dict, list[dict]]:
    output = work / "scores.jsonl"
    summary = json.loads(run(PY, "-m", "dpo_inv", "score", "--model", str(model), "--data", str(work / data),
                             "--output", str(output), *options).splitlines()[-1])  # fmt: skip
    return summary, [json.loads(line) for line in output.read_text().splitlines()]


def design(model: str) -> dict:
    script = str(ROOT / "scripts" / "design_ability.py")
    return json.loads(run(PY, script, model).splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work_dir", type=Path, default=ROOT / "outputs" / "stability_experiments")
    parser.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42])
    args = parser.parse_args()
    work = args.work_dir.resolve()
    prepare(work)
    results = work / "results.jsonl"
    done = [json.loads(line)["run"] for line in results.read_text().splitlines()] if results.is_file() else []
    base = [] if "base" in done else [("base", 42)]  # the base model is measured once per work_dir
    for name, seed in base + [(name, seed) for seed in args.seeds for name in args.only]:
        label = name if seed == 42 else f"{name}_seed{seed}"
        output = work / "runs" / label
        if name == "base":
            models = {"best": "vanilla/v_48_020", "final": "vanilla/v_48_020"}
            evals = []
        else:
            pairs, options = RUNS[name]
            train_file = build_pairs(work, *pairs)
            if "{sft}" in options:
                options = options.format(sft=sft(work, seed))
            run(PY, "-m", "dpo_inv.run", "--train_file", str(train_file), "--eval_variants_file",
                str(work / "dev" / "eval300.jsonl"), "--output_dir", str(output), *TRAINING.split(),
                *options.split(), "--seed", str(seed))  # fmt: skip
            models = {"best": str(output / "best"), "final": str(output / "final")}
            metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
            evals = [(m["step"], round(m["eval_spearman"], 4)) for m in metrics if "eval_spearman" in m]
        result = {"run": label, "seed": seed, "dev_eval_spearman": evals}
        for which, model in models.items():
            summary, _ = score(work, model, "test300.jsonl", "--decoding_order", "left_to_right")
            result[f"test_{which}"] = summary["spearman_per_structure_mean"]
        summary, rows = score(work, models["final"], "test40.jsonl", "--variant_scoring", "full",
                              "--decoding_order", "left_to_right")  # fmt: skip
        result["test_final_full_sequence"] = summary["spearman_per_structure_mean"]
        result["mean_logp_final"] = round(sum(r["logp"] for r in rows) / len(rows), 1)
        ability = design(models["best"])
        result["design_recovery_best"] = ability["recovery"]
        result["design_log_likelihood_best"] = ability["log_likelihood"]
        with open(results, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
