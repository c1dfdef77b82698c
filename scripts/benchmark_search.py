"""Memory and time of the k-nearest-neighbour search of long structures: all L x L distances at once, and a
chunk of rows at a time (`dpo_inv.models.features.SEARCH_CHUNK_DISTANCES`), as the models search.

    python scripts/benchmark_search.py --lengths 1500 6000 12000 --repeats 2

For each length L: the CA atoms of the structure `scripts/benchmark.py --lengths` trains on (the five-chain
complex `base_structure` cut after L residues, or repeated beyond its 815). The search runs whole and in
chunks alternating, `repeats` times each: the peak memory above that before the search (`benchmark.py`'s
measure: the process's resident memory on a CPU), the seconds, and whether the neighbours and distances are
those of the whole search, to the bit. One JSON line per search.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchmark import describe, peak_memory, reset_peak_memory, write_structure

import dpo_inv.models.features
from dpo_inv.structures.parse import parse_structure

CHUNK = dpo_inv.models.features.SEARCH_CHUNK_DISTANCES


def ca_atoms(base: Path, length: int, work_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The CA coordinates `[1, length, 3]` (missing ones at 0) and their mask `[1, length]`."""
    path = work_dir / f"{base.name.split('.')[0]}-L{length}.cif"
    write_structure(base, length, path)
    Ca = torch.cat([torch.from_numpy(chain.coords[:, 1]) for chain in parse_structure(path).values()])[None]
    return torch.nan_to_num(Ca), torch.isfinite(Ca).all(-1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 6000, 12000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base_structure", default="data/structures/1BD2.pdb.gz")
    parser.add_argument("--work_dir", default="outputs/benchmark")
    args = parser.parse_args()
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    features = dpo_inv.models.features.ProteinFeatures(128, 48)
    for length in args.lengths:
        Ca, mask = ca_atoms(Path(args.base_structure), length, work_dir)
        whole = None
        for repeat in range(args.repeats):
            for chunked in (False, True):
                dpo_inv.models.features.SEARCH_CHUNK_DISTANCES = CHUNK if chunked else 1 << 62
                before = reset_peak_memory(device)
                started = time.perf_counter()
                with torch.no_grad():
                    found = features._dist(Ca, mask)
                seconds = time.perf_counter() - started
                peak_mb = peak_memory(device) - before
                whole = whole or found
                same = all(torch.equal(a, b) for a, b in zip(found, whole, strict=True))
                line = {"device": describe(device), "length": length, "repeat": repeat, "chunked": chunked,
                        "peak_memory_mb": round(peak_mb, 1), "seconds": round(seconds, 3),
                        "same_as_whole": same}  # fmt: skip
                print(json.dumps(line), flush=True)
                del found


if __name__ == "__main__":
    main()
