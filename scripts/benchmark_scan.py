"""Time and memory of a saturation scan (`dpo-inv scan`: every single substitution of every position).

    python scripts/benchmark_scan.py [--structures S.pdb.gz ...] [--lengths 2000] [--repeats 2]

Scans each structure (default: a 48-residue domain, 1eteA with 134 residues, the AlphaFold2 model of AMIE
with 346 and the five-chain complex 1BD2 with 815), and each of `--lengths` (1BD2 repeated, as
`scripts/benchmark.py --lengths` builds it), `--repeats` times, in the default random order, parsing
included: seconds, positions per second and the peak memory above that before the scan (`benchmark.py`'s
measure: the process's resident memory on a CPU). One JSON line per scan.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchmark import describe, peak_memory, reset_peak_memory, write_structure

import dpo_inv
from dpo_inv.models.weights import load_model

ROOT = Path(__file__).resolve().parents[1]
STRUCTURES = [
    ROOT / "data" / "adapt" / "2jws_A_7-54.pdb.gz",
    ROOT / "data" / "structures" / "1eteA.pdb.gz",
    ROOT.parent / "shared" / "function" / "structures" / "AMIE_PSEAE_Wrenbeck_2017.pdb.gz",
    ROOT / "data" / "structures" / "1BD2.pdb.gz",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--structures", type=Path, nargs="*", default=[s for s in STRUCTURES if s.exists()])
    parser.add_argument("--lengths", type=int, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="vanilla/v_48_020")
    parser.add_argument("--work_dir", type=Path, default=Path("outputs/benchmark_scan"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    structures = list(args.structures)
    for length in args.lengths:
        structures.append(args.work_dir / f"1BD2-L{length}.cif")
        write_structure(STRUCTURES[-1], length, structures[-1])
    model, device = load_model(args.model).eval(), torch.device("cpu")
    dpo_inv.scan(model, structures[0])  # warm-up
    for structure in structures:
        for _ in range(args.repeats):
            before = reset_peak_memory(device)
            start = time.perf_counter()
            rows = dpo_inv.scan(model, structure)
            seconds = time.perf_counter() - start
            positions = len(rows) // 19
            line = {"device": describe(device), "structure": structure.name, "positions": positions}
            line.update(seconds=round(seconds, 2), positions_per_second=round(positions / seconds, 1))
            print(json.dumps({**line, "peak_memory_mb": round(peak_memory(device) - before)}), flush=True)


if __name__ == "__main__":
    main()
