"""Speed of variant scoring: every single mutant (19 per position) of real small domains.

    python scripts/benchmark_variants.py [--domains 8] [--full_sample 128]

Takes the first `--domains` domains of the stability data whose chains have `--min_length` to
`--max_length` residues, writes all 19·L single mutants of each as a sequences file, and times
`dpo-inv score`'s two paths on it, structures already parsed (cached): `conditional` on every mutant, and
`full` (two full-sequence passes per record, batch 16) on a seeded sample of `--full_sample` mutants. Prints
one JSON line per path: mutants, seconds, mutants per second.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import datasets
import torch
from torch.utils.data import Subset

from dpo_inv.data.batches import ExampleDataset
from dpo_inv.data.dataset import VARIANTS, load_records
from dpo_inv.models.variants import conditional_deltas
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.score import ScoreOptions, score_dataset

STABILITY = Path(__file__).resolve().parents[2] / "shared" / "stability" / "train.jsonl"


def single_mutants(source: Path, domains: int, min_length: int, max_length: int) -> list[dict]:
    wildtypes: dict[str, dict] = {}
    for line in source.read_text().splitlines():
        row = json.loads(line)
        if row["domain"] not in wildtypes and min_length <= len(row["wildtype_seq"]) <= max_length:
            wildtypes[row["domain"]] = row
        if len(wildtypes) == domains:
            break
    records = []
    for row in wildtypes.values():
        wildtype = row["wildtype_seq"]
        pdb_file = str((source.parent / row["pdb_file"]).resolve())
        for i, native in enumerate(wildtype):
            for aa in ALPHABET[:20]:
                if aa != native:
                    sequence = wildtype[:i] + aa + wildtype[i + 1 :]
                    records.append({"pdb_file": pdb_file, "chain_id": row["chain_id"], "sequence": sequence,
                                    "wildtype_seq": wildtype})  # fmt: skip
    return records


def report(common: dict, variant_scoring: str, mutants: int, seconds: float) -> None:
    speed = {
        "mutants": mutants,
        "seconds": round(seconds, 2),
        "mutants_per_second": round(mutants / seconds, 1),
    }
    print(json.dumps({**common, "variant_scoring": variant_scoring, **speed}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=STABILITY)
    parser.add_argument("--domains", type=int, default=8)
    parser.add_argument("--min_length", type=int, default=55)
    parser.add_argument("--max_length", type=int, default=65)
    parser.add_argument("--full_sample", type=int, default=128)
    parser.add_argument("--model", default="vanilla/v_48_020")
    parser.add_argument("--work_dir", type=Path, default=Path("outputs/benchmark_variants"))
    args = parser.parse_args()
    datasets.disable_progress_bars()
    records = single_mutants(args.data, args.domains, args.min_length, args.max_length)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    path = args.work_dir / "single_mutants.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = ExampleDataset(load_records(path, args.work_dir / "cache", kind=VARIANTS))
    model = load_model(args.model).eval()
    device = torch.device("cpu")
    common = {
        "device": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "domains": args.domains,
        "mean_length": round(sum(len(r["wildtype_seq"]) for r in records) / len(records), 1),
    }

    conditional_deltas(model, dataset, device, records=range(19))  # warm-up
    start = time.perf_counter()
    conditional_deltas(model, dataset, device)
    seconds = time.perf_counter() - start
    report(common, "conditional", len(records), seconds)

    sample = sorted(random.Random(0).sample(range(len(records)), min(args.full_sample, len(records))))
    config = ScoreOptions(decoding_order="random", batch_size=16)
    start = time.perf_counter()
    score_dataset([model], Subset(dataset, sample), config, device, ("sequence", "wildtype"))
    seconds = time.perf_counter() - start
    report(common, "full", len(sample), seconds)


if __name__ == "__main__":
    main()
