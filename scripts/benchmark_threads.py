"""Threads on a busy machine: the wall time of each command with one thread, with one thread per core and
with the threads dpo_inv chooses (`auto`: no OMP_NUM_THREADS), on a quiet machine and beside a neighbour
that keeps every core busy (docs/benchmarks.md, "Threads").

    python scripts/benchmark_threads.py --repeats 2

The settings alternate within each repeat, so that a slow patch of a shared machine falls on all of them.
Prints one JSON line per run, then the median of each command, condition and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOUR = "import torch\ntorch.set_num_threads({})\na = torch.randn(800, 800)\nwhile True:\n    a @ a\n"


def commands(tmp: Path) -> dict[str, list[str]]:
    """What each command runs: the bundled examples, at the size a user's first run has."""
    data = ROOT / "data"
    return {
        "adapt": ["-m", "dpo_inv", "adapt", str(data / "adapt" / "labelled.jsonl"), "--output_dir",
                  str(tmp / "adapt"), "--cache_dir", str(tmp / "cache")],
        "sample": ["-m", "dpo_inv", "sample", "--structure", str(data / "structures" / "1eteA.pdb.gz"),
                   "--num_samples", "16", "--output_dir", str(tmp / "sample")],
        "score": ["-m", "dpo_inv", "score", "--data", str(data / "adapt" / "candidates.jsonl"), "--output",
                  str(tmp / "scored.jsonl"), "--cache_dir", str(tmp / "cache")],
        "scan": ["-m", "dpo_inv", "scan", "--structure", str(data / "structures" / "1eteA.pdb.gz"),
                 "--output_dir", str(tmp / "scan")],
        "train": ["-m", "dpo_inv.run", "--config", str(ROOT / "configs" / "example.yaml"), "--max_steps", "4",
                  "--output_dir", str(tmp / "train"), "--cache_dir", str(tmp / "cache")],
    }  # fmt: skip


def run(command: list[str], threads: str) -> float:
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    if threads != "auto":
        env["OMP_NUM_THREADS"] = threads
    if "--output_dir" in command:  # a fresh folder: training would resume, the others refuse
        output = Path(command[command.index("--output_dir") + 1])
        shutil.rmtree(output, ignore_errors=True)
    began = time.perf_counter()
    subprocess.run([sys.executable, *command], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="Commands to time (default: all).")
    parser.add_argument("--settings", nargs="*", help="Thread settings (default: 1, the cores, auto).")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    settings = args.settings or list(dict.fromkeys(["1", str(cores), "auto"]))
    results: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        todo = {name: c for name, c in commands(Path(tmp)).items() if not args.only or name in args.only}
        for command in todo.values():  # warm-up: structures parsed and cached, files written once
            run(command, "1")
        for repeat in range(args.repeats):
            for condition in ("quiet", "busy"):
                neighbour = None
                if condition == "busy":
                    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR.format(cores)])
                    time.sleep(2)
                try:
                    for name, command in todo.items():
                        for threads in settings if repeat % 2 == 0 else settings[::-1]:
                            seconds = run(command, threads)
                            results.setdefault((name, condition, threads), []).append(seconds)
                            print(json.dumps({"command": name, "condition": condition, "threads": threads,
                                              "seconds": round(seconds, 1)}), flush=True)  # fmt: skip
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.wait()
    print(f"\nmedian seconds ({cores} cores; busy: a neighbour process computing on {cores} threads)")
    print(f"{'command':8} {'condition':9} " + " ".join(f"{t:>12}" for t in settings))
    for name in todo:
        for condition in ("quiet", "busy"):
            cells = [f"{np.median(results[name, condition, t]):>12.1f}" for t in settings]
            print(f"{name:8} {condition:9} " + " ".join(cells))


if __name__ == "__main__":
    main()
