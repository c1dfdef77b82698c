"""Memory and time of the k-nearest-neighbour search of long structures: all L x L distances at once, and a
chunk of rows at a time (`dpo_inv.models.features.SEARCH_CHUNK_DISTANCES`), as the models search.

    python scripts/benchmark_search.py --lengths 1500 6000 12000 --repeats 2

For each length L: the CA atoms of the five-chain complex `base_structure` (815 residues) cut after L, or
repeated with copy k moved k x 250 Å along x beyond (as `scripts/benchmark.py` builds long structures). Each
search runs in a process of its own (forked), whole and in chunks alternating, `repeats` times: the peak
resident memory above that before the search (VmHWM - VmRSS), the seconds, and whether the neighbours and
distances are those of the whole search, to the bit. One JSON line per search.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
from benchmark import COPY_SPACING

import dpo_inv.models.features
from dpo_inv.structures.parse import parse_structure

ROOT = Path(__file__).resolve().parents[1]


def proc_mb(key: str) -> float:
    """A `key: N kB` line of /proc/self/status, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1000
    raise KeyError(key)


def cpu() -> str:
    """The CPU's model name."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")


def ca_atoms(base: Path, length: int) -> np.ndarray:
    """CA coordinates `[length, 3]` of `base`'s chains in file order, cut or repeated with shifted copies."""
    ca = np.concatenate([chain.coords[:, 1] for chain in parse_structure(base).values()])
    copies = -(-length // len(ca))
    shift = np.array([COPY_SPACING, 0.0, 0.0], np.float32)
    return (ca[None] + np.arange(copies, dtype=np.float32)[:, None, None] * shift).reshape(-1, 3)[:length]


def search(ca: np.ndarray, chunked: bool, results: multiprocessing.Queue) -> None:
    """One search in this process: its peak memory, seconds, neighbours and distances."""
    import torch

    if not chunked:
        dpo_inv.models.features.SEARCH_CHUNK_DISTANCES = 1 << 62
    features = dpo_inv.models.features.ProteinFeatures(128, 48)
    Ca = torch.from_numpy(ca)[None]
    mask = torch.isfinite(Ca).all(-1).float()
    Ca = torch.nan_to_num(Ca)
    before = proc_mb("VmRSS")
    started = time.perf_counter()
    with torch.no_grad():
        D, E_idx = features._dist(Ca, mask)
    seconds = time.perf_counter() - started
    results.put((proc_mb("VmHWM") - before, seconds, D.numpy(), E_idx.numpy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 6000, 12000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base_structure", default=str(ROOT / "data" / "structures" / "1BD2.pdb.gz"))
    args = parser.parse_args()
    context = multiprocessing.get_context("fork")  # the parent has not computed with torch: no thread pool
    for length in args.lengths:
        ca = ca_atoms(Path(args.base_structure), length)
        whole = None
        for repeat in range(args.repeats):
            for chunked in (False, True):
                results = context.Queue()
                process = context.Process(target=search, args=(ca, chunked, results))
                process.start()
                peak_mb, seconds, D, E_idx = results.get()
                process.join()
                whole = whole or (D, E_idx)
                same = bool(np.array_equal(D, whole[0]) and np.array_equal(E_idx, whole[1]))
                line = {"device": cpu(), "length": length,
                        "repeat": repeat, "chunked": chunked, "peak_memory_mb": round(peak_mb, 1),
                        "seconds": round(seconds, 3), "same_as_whole": same}  # fmt: skip
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
