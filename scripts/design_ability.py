"""Design ability of models: native recovery and mean log-likelihood of sampled designs on backbones none
of them was trained on, with the same temperature, seeds and structures for every model.

    python scripts/design_ability.py vanilla/v_48_020 outputs/stability/final [--num_samples 4]

Each model samples `--num_samples` sequences at `--temperature` (0.1) for each of the 12 single-chain
backbones below (the example's 6 held-out chains and 6 of its training chains, none in the stability
data); one JSON line per model: the mean over structures of the samples' recovery and log-likelihood
(the mean log p per designed residue, as `dpo-inv sample` reports them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import dpo_inv

STRUCTURES = Path(__file__).resolve().parents[1] / "data" / "structures"
BACKBONES = ("3ny7A", "3nzmA", "3on9A", "3pivA", "3q4oA", "3so6A",
             "1eteA", "1h4aX", "1i8nA", "1lpbA", "1or4A", "2xcjA")  # fmt: skip


def design_ability(model: str, num_samples: int, temperature: float, seed: int) -> dict:
    """The mean over the backbones of the samples' recovery and log-likelihood under `model`."""
    samples = dpo_inv.sample(model, [STRUCTURES / f"{name}.pdb.gz" for name in BACKBONES],
                             num_samples=num_samples, temperature=temperature, seed=seed)  # fmt: skip
    by_structure = {}
    for record in samples:
        by_structure.setdefault(record["structure"], []).append(record)
    recovery = [np.mean([r["recovery"] for r in records]) for records in by_structure.values()]
    likelihood = [np.mean([r["log_likelihood"] for r in records]) for records in by_structure.values()]
    return {"model": model, "recovery": round(float(np.mean(recovery)), 4),
            "log_likelihood": round(float(np.mean(likelihood)), 4), "structures": len(by_structure),
            "num_samples": num_samples, "temperature": temperature, "seed": seed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+", help="Model names or saved directories.")
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model in args.models:
        print(json.dumps(design_ability(model, args.num_samples, args.temperature, args.seed)), flush=True)


if __name__ == "__main__":
    main()
