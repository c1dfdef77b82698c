"""Supervised fine-tuning on a family of structures: does it raise held-out native recovery and lower
perplexity on that family, and what does it cost on other proteins?

    python scripts/sft_experiments.py --work_dir outputs/sft --seeds 0 1 2 \
        [--learning_rate 3e-5] [--backbone_noise 0.2]

The family: the 77 small domains of `../shared/stability/structures` (AlphaFold2 models), split by domain with
homologues kept together (`split_by_domain.clusters`: same PDB code or >= 40% local identity), 20% of the
domains held out per seed, and 15% of the rest (`--valid`, homologues kept together again) to keep the best
model by eval loss (`best/`, evaluated from the start, so it may be the base model). For each seed, `dpo-inv
train --loss_type sft` trains on the others' structures (their native sequences; ProteinMPNN's objective:
label smoothing 0.1, `--backbone_noise`: by default the model's 0.20 Å, dropout). The base model and the SFT
model are then measured on the held-out domains and on the 26 single-chain crystal structures of
`../shared/structures`: perplexity (exp of the mean NLL per residue, one random decoding order per structure,
no noise) and native recovery (greedy decoding). One JSON line per seed is appended to WORK_DIR/results.jsonl;
the last line printed is the table's summary.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split_by_domain import clusters  # noqa: E402

from dpo_inv.data.batches import ExampleDataset, collate  # noqa: E402
from dpo_inv.data.dataset import STRUCTURES, load_records  # noqa: E402
from dpo_inv.models.sampling import sample_sequences  # noqa: E402
from dpo_inv.models.weights import load_model  # noqa: E402
from dpo_inv.training.loss import batch_ranks, example_seeds  # noqa: E402
from dpo_inv.training.sft import sft_step  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
STABILITY = SHARED / "stability"
CRYSTALS = sorted(p for p in (SHARED / "structures").glob("*.pdb.gz") if len(p.name.split(".")[0]) == 5)


def family() -> dict[str, str]:
    """Domain -> wild-type sequence, from the stability records."""
    wildtypes = {}
    for line in (STABILITY / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        wildtypes.setdefault(row["domain"], row["wildtype_seq"])
    return wildtypes


def split(wildtypes: dict[str, str], held_out: float, seed: int) -> tuple[list[str], list[str]]:
    groups = clusters(wildtypes, 0.4)
    random.Random(seed).shuffle(groups)
    test: list[str] = []
    for group in groups:
        if len(test) >= held_out * len(wildtypes):
            break
        test += group
    return sorted(set(wildtypes) - set(test)), sorted(test)


def write_records(path: Path, domains: list[str]) -> Path:
    rows = [{"pdb_file": str(STABILITY / "structures" / f"{d}.pdb.gz"), "chain_id": "A"} for d in domains]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@torch.no_grad()
def measure(model_name: str, records: list[dict], cache_dir: Path) -> dict[str, float]:
    """Perplexity and mean-token accuracy (one random order, teacher forcing) and greedy recovery, per
    residue over all structures, without noise or dropout."""
    model = load_model(model_name).eval()
    dataset = ExampleDataset(load_records(records, cache_dir, kind=STRUCTURES))
    totals = {"nll": 0.0, "correct": 0.0, "num_tokens": 0.0, "recovered": 0.0}
    for i in range(len(dataset)):
        batch = collate([dataset[i]])
        _, rows = sft_step(model, batch, batch_ranks(batch, 0, 1, "random"), 0.0)
        for name in ("nll", "correct", "num_tokens"):
            totals[name] += float(rows[name].sum())
        tokens = sample_sequences(model, batch, 1, 0.0, example_seeds(0, batch["index"], 0)).tokens[:, 0]
        totals["recovered"] += float(((tokens == batch["sequence"]) * batch["loss_mask"]).sum())
    n = totals["num_tokens"]
    return {
        "perplexity": round(math.exp(totals["nll"] / n), 3),
        "accuracy": round(totals["correct"] / n, 4),
        "recovery": round(totals["recovered"] / n, 4),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--work_dir", type=Path, default=Path("outputs/sft"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--held_out", type=float, default=0.2)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--valid", type=float, default=0.15, help="of the training domains: pick best/")
    parser.add_argument("--backbone_noise", type=float, default=0.2, help="Å; 0.2 is v_48_020's own")
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--model", default="vanilla/v_48_020")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache = args.work_dir / "cache"
    wildtypes = family()
    crystals = [{"pdb_file": str(p)} for p in CRYSTALS]
    results = []
    for seed in args.seeds:
        train, test = split(wildtypes, args.held_out, seed)
        train, valid = split({d: wildtypes[d] for d in train}, args.valid, seed + 1000)
        folder = args.work_dir / f"seed{seed}"
        folder.mkdir(exist_ok=True)
        train_file = write_records(folder / "train.jsonl", train)
        valid_file = write_records(folder / "valid.jsonl", valid)
        test_file = write_records(folder / "held_out.jsonl", test)
        output = folder / "sft"
        command = [sys.executable, "-m", "dpo_inv.run", "--model_name_or_path", args.model,
                   "--loss_type", "sft", "--train_file", str(train_file), "--eval_file", str(valid_file),
                   "--backbone_noise", str(args.backbone_noise), "--max_steps", str(args.max_steps),
                   "--learning_rate", str(args.learning_rate),
                   "--per_device_train_batch_size", str(args.batch_size), "--warmup_steps", "10",
                   "--logging_steps", str(args.eval_steps), "--eval_steps", str(args.eval_steps),
                   "--save_steps", str(args.eval_steps), "--eval_on_start", "true", "--seed", str(seed),
                   "--cache_dir", str(cache), "--output_dir", str(output)]  # fmt: skip
        shutil.rmtree(output, ignore_errors=True)
        subprocess.run(command, check=True)
        held_out = [json.loads(line) for line in test_file.read_text().splitlines()]
        result = {"seed": seed, "train_domains": len(train), "valid_domains": len(valid),
                  "held_out_domains": len(test), "learning_rate": args.learning_rate,
                  "backbone_noise": args.backbone_noise}  # fmt: skip
        for name, model in (("base", args.model), ("sft", str(output / "best"))):
            result[name] = {
                "family": measure(model, held_out, cache),
                "crystals": measure(model, crystals, cache),
            }
        print(json.dumps(result), flush=True)
        with open(args.work_dir / "results.jsonl", "a") as handle:
            handle.write(json.dumps(result) + "\n")
        results.append(result)
    summary = {}
    for name in ("base", "sft"):
        for where in ("family", "crystals"):
            for metric in ("perplexity", "accuracy", "recovery"):
                values = [r[name][where][metric] for r in results]
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                summary[f"{name}/{where}/{metric}"] = [round(statistics.mean(values), 4), round(spread, 4)]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
