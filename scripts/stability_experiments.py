"""The measurements behind docs/stability.md: alignment settings on the stability data, judged on domains
never trained on.

    python scripts/stability_experiments.py [--work_dir outputs/stability_experiments] [--only NAME ...]
        [--seeds 42 1 2] [--data ../shared/stability/train.jsonl]
    python scripts/stability_experiments.py --average RUN RUN ... [--work_dir ...]

The 77 domains are split by `scripts/split_by_domain.py` (homologues kept together) into 51 for training
and model choice and 26 held out for the test (seed 1); the 51 again into 40 that train and 11 whose
variants (300 per domain) pick the best eval (seed 2). Each run trains with `eval_on_start`, evaluates
every `eval_steps` on the 11 and keeps `best/` by `eval_spearman`; `best/` and `final/` are then scored on
300 variants per test domain (conditional, left to right), and `final/` also with the full-sequence
estimator on 40 per test domain, which gives the mean log p of the variants too; `scripts/design_ability.py`
measures the designs `best/` samples on 12 other backbones. `--seeds` repeats each run with those training
seeds (42, the trainer's default, names the run alone). One JSON line per run is appended to
`WORK_DIR/results.jsonl`. Each run takes 6-20 minutes on two CPU cores. Runs named `sft_then_...` first
fine-tune on the training domains' structures (SFT, docs/sft.md) and align that model; runs named `lora_...`
train LoRA adapters (`--use_peft`) instead of every weight; runs ending `_v_48_0NN` start from that noise
level's checkpoint instead of vanilla/v_48_020.

The base models (`base`: vanilla/v_48_020; `base_v_48_0NN`: the other noise levels) are measured like a run,
once per work_dir: `base` before the others when no `--only` is given, any of them when `--only` names it.
Each run keeps its per-variant scores in `WORK_DIR/runs/RUN/` (`test300_best.jsonl`, ...), so runs may go
on in parallel processes on one work_dir (prepare the data and the pairs first, in one process).
`--average RUN ...` measures the ensemble of those runs' `best/` models (or base models): the mean of their
`delta_logp` per test variant, ranked per test domain, and appends it to results.jsonl as `average(...)`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np

from dpo_inv.data.records import rebase_paths, write_jsonl
from dpo_inv.models.variants import mean_and_median, spearman_by_structure

ROOT = Path(__file__).resolve().parents[1]
STABILITY = ROOT.parent / "shared" / "stability" / "train.jsonl"
PY = sys.executable


def lora(r: int, lr: str, anchor: float, targets: tuple[str, ...] = ()) -> str:
    """The trainer options of a lora_... run: 400 steps, a LoRA adapter of rank r (alpha 2r) on `targets`
    (default: every message-passing layer's linear maps and the output head), learning rate `lr` (replacing
    TRAINING's), anchor weight `anchor`."""
    options = f"--max_steps 400 --anchor_weight {anchor} --use_peft true --lora_r {r} --lora_alpha {2 * r} "
    options += f"--learning_rate {lr}"
    return options + (" --lora_target_modules " + " ".join(targets) if targets else "")


DECODER = tuple(
    f"decoder_layers.{i}.{m}" for i in range(3) for m in ("W1", "W2", "W3", "dense.W_in", "dense.W_out")
)
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
    # the recipe's row on ProteinMPNN's other noise levels (0.02, 0.10, 0.30 Å), to average with v_48_020's
    **{f"same_position_200_400steps_anchor0.1_{version}": (
        ("same_position", 1, 200, ""),
        f"--max_steps 400 --anchor_weight 0.1 --model_name_or_path vanilla/{version}")
       for version in ("v_48_002", "v_48_010", "v_48_030")},
    # LoRA adapters instead of every weight (alpha = 2 r; lora_dropout 0.05)
    "lora_r8_lr5e-4_anchor0.1": (("same_position", 1, 200, ""), lora(8, "5e-4", 0.1)),
    "lora_r8_lr5e-4_anchor0": (("same_position", 1, 200, ""), lora(8, "5e-4", 0)),
    "lora_r32_lr5e-4_anchor0.1": (("same_position", 1, 200, ""), lora(32, "5e-4", 0.1)),
    "lora_r8_lr2e-3_anchor0.1": (("same_position", 1, 200, ""), lora(8, "2e-3", 0.1)),
    "lora_r8_lr2e-4_anchor0.1": (("same_position", 1, 200, ""), lora(8, "2e-4", 0.1)),
    "lora_r8_lr1e-4_anchor0.1": (("same_position", 1, 200, ""), lora(8, "1e-4", 0.1)),
    "lora_r8_lr1e-4_anchor0.1_600steps": (("same_position", 1, 200, ""),
                                          lora(8, "1e-4", 0.1) + " --max_steps 600"),
    "lora_r8_lr1.5e-4_anchor0.1": (("same_position", 1, 200, ""), lora(8, "1.5e-4", 0.1)),
    "lora_r8_lr2e-4_anchor0.2": (("same_position", 1, 200, ""), lora(8, "2e-4", 0.2)),
    "lora_r16_lr1e-4_anchor0.1": (("same_position", 1, 200, ""), lora(16, "1e-4", 0.1)),
    # the decoder's layers only, the encoder and the output head frozen (a target "W_out" would also take the
    # encoder layers' dense.W_out: a name matches every module whose name ends with it)
    "lora_r8_decoder_lr5e-4_anchor0.1": (("same_position", 1, 200, ""), lora(8, "5e-4", 0.1, DECODER)),
}  # fmt: skip
# The base models, measured as runs are (a run's gain is over `base`)
BASES = {"base": "vanilla/v_48_020",
         **{f"base_{v}": f"vanilla/{v}" for v in ("v_48_002", "v_48_010", "v_48_030")}}  # fmt: skip
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


def run(*args: str, log: Path | None = None) -> str:
    """The stdout of a command; its stderr written to `log` as it goes, if given; on failure, its end."""
    if log is None:
        done = subprocess.run([*args], cwd=ROOT, capture_output=True, text=True)
        errors = done.stderr
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            done = subprocess.run([*args], cwd=ROOT, stdout=subprocess.PIPE, stderr=handle, text=True)
        errors = log.read_text()
    if done.returncode != 0:
        sys.stderr.write(errors[-4000:])
        raise subprocess.CalledProcessError(done.returncode, args)
    return done.stdout


def subsample(source: Path, target: Path, per_domain: int) -> None:
    rows = defaultdict(list)
    for line in source.read_text().splitlines():
        row = json.loads(line)
        rows[row["domain"]].append(row)
    rng = random.Random(0)
    picked = [row for domain in rows.values() for row in rng.sample(domain, min(per_domain, len(domain)))]
    write_jsonl(target, rebase_paths(picked, source.parent, target.parent))


def prepare(work: Path, data: Path = STABILITY) -> None:
    if (work / "dev" / "eval300.jsonl").is_file():
        return
    split = str(ROOT / "scripts" / "split_by_domain.py")
    run(PY, split, str(data), "--output_dir", str(work / "split"), "--held_out", "0.33", "--seed", "1")
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


def score(work: Path, model: str, data: str, output: Path, *options: str) -> tuple[dict, list[dict]]:
    """Score `work/data` with `model` into `output` (one file per run and data, so that runs can go on in
    parallel); the summary and the scored rows."""
    output.parent.mkdir(parents=True, exist_ok=True)
    summary = json.loads(run(PY, "-m", "dpo_inv", "score", "--model", str(model), "--data", str(work / data),
                             "--output", str(output), *options).splitlines()[-1])  # fmt: skip
    return summary, [json.loads(line) for line in output.read_text().splitlines()]


def design(model: str) -> dict:
    script = str(ROOT / "scripts" / "design_ability.py")
    return json.loads(run(PY, script, model).splitlines()[-1])


def keep(path: Path, result: dict, seconds: dict, started: float, what: str, **values: object) -> None:
    """Add `values` to a run's `result` and the time `what` took to `seconds`, and write both to `path`: each
    measurement is kept as soon as it is made."""
    result.update(values)
    seconds[what] = round(time.monotonic() - started) - sum(seconds.values())
    write_jsonl(path, [{**result, "seconds": seconds}])


def average(work: Path, names: list[str]) -> dict:
    """The ensemble of runs (their `best/` models' scores on the test variants): the mean of the runs'
    `delta_logp` per variant, its mean per-domain Spearman, and each run's own."""
    files = [work / "runs" / name / "test300_best.jsonl" for name in names]
    scored = [[json.loads(line) for line in file.read_text().splitlines()] for file in files]
    keys = [[(r["pdb_file"], r["sequence"]) for r in rows] for rows in scored]
    if any(k != keys[0] for k in keys):
        raise SystemExit(f"--average: {', '.join(names)} scored different test variants")
    domains = np.array([r["pdb_file"] for r in scored[0]])
    labels = np.array([float(r["label"]) for r in scored[0]])

    def per_domain_mean(values: np.ndarray) -> float:
        return round(mean_and_median(spearman_by_structure(values, labels, domains))[0], 4)

    deltas = np.array([[r["delta_logp"] for r in rows] for rows in scored], dtype=np.float64)
    return {"run": f"average({','.join(names)})", "members": names,
            "members_test_best": [per_domain_mean(d) for d in deltas],
            "test_best": per_domain_mean(deltas.mean(0)),
            "variants": len(labels), "domains": len(set(domains.tolist()))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work_dir", type=Path, default=ROOT / "outputs" / "stability_experiments")
    parser.add_argument("--only", nargs="*", choices=list(BASES) + list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42])
    parser.add_argument("--data", type=Path, default=STABILITY, help="The stability data (prepare).")
    parser.add_argument(
        "--extra_options",
        default="",
        help="Trainer options appended to every run's (e.g. '--max_steps 20' for a trial).",
    )
    parser.add_argument(
        "--no_full_sequence",
        action="store_true",
        help="Leave out the full-sequence estimator on test40 (and the mean log p).",
    )
    parser.add_argument("--pairs_only", action="store_true", help="Prepare the data and the pairs, no run.")
    parser.add_argument("--average", nargs="+", metavar="RUN", help="Measure the ensemble of these runs.")
    args = parser.parse_args()
    work = args.work_dir.resolve()
    prepare(work, args.data)
    results = work / "results.jsonl"
    if args.average:
        result = average(work, args.average)
        with open(results, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
        return
    only = args.only if args.only is not None else ["base", *RUNS]
    if args.pairs_only:
        for pairs in sorted({RUNS[name][0] for name in only if name in RUNS}):
            print(build_pairs(work, *pairs), flush=True)
        return
    done = [json.loads(line)["run"] for line in results.read_text().splitlines()] if results.is_file() else []
    bases = [(name, 42) for name in only if name in BASES and name not in done]  # once per work_dir
    for name, seed in bases + [(name, seed) for seed in args.seeds for name in only if name in RUNS]:
        label = name if seed == 42 else f"{name}_seed{seed}"
        output = work / "runs" / label
        started = time.monotonic()
        if name in BASES:
            models = {"best": BASES[name], "final": BASES[name]}
            evals = []
        else:
            pairs, options = RUNS[name]
            train_file = build_pairs(work, *pairs)
            if "{sft}" in options:
                options = options.format(sft=sft(work, seed))
            run(PY, "-m", "dpo_inv.run", "--train_file", str(train_file), "--eval_variants_file",
                str(work / "dev" / "eval300.jsonl"), "--output_dir", str(output), *TRAINING.split(),
                *options.split(), *args.extra_options.split(), "--seed", str(seed),
                log=work / "runs" / f"{label}.log")  # fmt: skip
            models = {"best": str(output / "best"), "final": str(output / "final")}
            metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
            evals = [(m["step"], round(m["eval_spearman"], 4)) for m in metrics if "eval_spearman" in m]
        result = {"run": label, "seed": seed, "dev_eval_spearman": evals}
        seconds = {"train": round(time.monotonic() - started)}
        kept = partial(keep, output / "result.jsonl", result, seconds, started)
        summary, _ = score(work, models["best"], "test300.jsonl", output / "test300_best.jsonl",
                           "--decoding_order", "left_to_right")  # fmt: skip
        kept("test_best", test_best=summary["spearman_per_structure_mean"])
        ability = design(models["best"])
        kept(
            "design",
            design_recovery_best=ability["recovery"],
            design_log_likelihood_best=ability["log_likelihood"],
        )
        if models["final"] == models["best"]:  # a base model: scored once
            shutil.copyfile(output / "test300_best.jsonl", output / "test300_final.jsonl")
        else:
            summary, _ = score(work, models["final"], "test300.jsonl", output / "test300_final.jsonl",
                               "--decoding_order", "left_to_right")  # fmt: skip
        kept("test_final", test_final=summary["spearman_per_structure_mean"])
        if not args.no_full_sequence:
            summary, rows = score(work, models["final"], "test40.jsonl", output / "test40_final_full.jsonl",
                                  "--variant_scoring", "full",
                                  "--decoding_order", "left_to_right")  # fmt: skip
            kept("test_full_sequence", test_final_full_sequence=summary["spearman_per_structure_mean"],
                 mean_logp_final=round(sum(r["logp"] for r in rows) / len(rows), 1))  # fmt: skip
        result["seconds"] = seconds
        with open(results, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
