"""Speed of the parse/cache path: structures/s on a first (parsing) run and on a cached run.

    python scripts/benchmark_data.py [--data FILE ...] [--num_proc N]

Prints one JSON line. The default data are the bundled example files.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import datasets

from dpo_inv.data.dataset import load_pairs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        nargs="+",
        default=["data/pairs/train.jsonl", "data/pairs/val.jsonl", "data/pairs/multichain.jsonl"],
    )
    parser.add_argument("--num_proc", type=int, default=None)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as cache_dir:
        result = {"files": args.data, "num_proc": args.num_proc}
        for run in ("first", "cached"):
            start = time.perf_counter()
            loaded = [load_pairs(path, cache_dir=cache_dir, num_proc=args.num_proc) for path in args.data]
            seconds = time.perf_counter() - start
            structures = sum(len(d.structures) for d in loaded)
            residues = sum(sum(d.structures["length"]) for d in loaded)
            result.update(
                {
                    "pairs": sum(len(d.pairs) for d in loaded),
                    "structures": structures,
                    "residues": residues,
                    f"{run}_seconds": round(seconds, 3),
                    f"{run}_structures_per_second": round(structures / seconds, 1),
                }
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
