"""Wall time of `python -m dpo_inv adapt` on N labelled single mutants of one stability domain, start-up,
parsing and cross-validation included (docs/adapt.md, "Speed").

    python scripts/benchmark_adapt.py --domain 2hdz_A_11-60 --n 96 --repeats 3

Run it on a quiet machine: a busy neighbour halves CPU throughput. Prints one JSON line per run and the
median.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "stability" / "train.jsonl")
    parser.add_argument("--domain", default="2hdz_A_11-60")
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launcher", default="", help="e.g. 'accelerate launch --num_processes 2'")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.data.read_text().splitlines() if f'"{args.domain}"' in line]
    chosen = [records[i] for i in np.random.default_rng(0).permutation(len(records))[: args.n]]
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        labelled = Path(tmp) / "labelled.jsonl"
        labelled.write_text(
            "".join(
                json.dumps({**r, "pdb_file": str(args.data.parent / r["pdb_file"])}) + "\n" for r in chosen
            )
        )
        command = [*(args.launcher.split() or [sys.executable]), "-m", "dpo_inv", "adapt"]
        for repeat in range(args.repeats):
            start = time.perf_counter()
            subprocess.run(
                [*command, str(labelled), "--output_dir", str(Path(tmp) / f"out{repeat}"),
                 "--cache_dir", str(Path(tmp) / "cache")],
                check=True, capture_output=True, cwd=ROOT,
            )  # fmt: skip
            times.append(time.perf_counter() - start)
            print(json.dumps({"domain": args.domain, "length": len(chosen[0]["wildtype_seq"]), "n": args.n,
                              "seconds": round(times[-1], 1)}), flush=True)  # fmt: skip
    print(f"median {np.median(times):.1f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
