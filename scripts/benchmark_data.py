"""Speed and memory of the data path: from data files to the first training batch, and the loader alone.

    python scripts/benchmark_data.py [--data FILE ...] [--dataset_num_proc N]    # the example files
    python scripts/benchmark_data.py --num_structures 10000 --num_pairs 1000000 --processes 1 2
    python scripts/benchmark_data.py --loader --lengths 150 600 --dataloader_num_workers 0 1 2

Example files: structures/s on a first (parsing) run of `load_records` and on a cached run.

Scale (`--num_structures`, `--num_pairs`): WORK_DIR/scale-S-P/ holds S structure files, hard links of the 26
chains of the example pairs (84-173 residues) under other names, so each is parsed, and P pairs of random
sequences spread evenly over them (`--num_pairs 0`: one structure record per file, as SFT trains on). For
each number of processes, `torchrun` starts the script's worker, which does what the trainer does before its
first step: `load_data` (rank 0 validates the records and parses the structures into the Arrow cache; the
other ranks read the cache), the length-grouped DataLoader, its first batch. Each is launched twice: with an
empty cache (first start), then again (cached start). One JSON line per launch: seconds from launch to the
first batch; per rank, seconds in `load_data`, peak resident memory (`peak_rss_mb`, and of the processes that
parsed, `parse_workers_peak_rss_mb`), and resident memory at the first batch split into private memory
(`rss_private_mb`: Python objects, arrays) and pages of files (`rss_file_mb`: the memory-mapped tables, shared
by the ranks); the cache's size on disk.

Loader (`--loader`): the collated batches of `ExampleDataset` (no model) of each length L in residues
(`--lengths`; the complex 1BD2 cut after L residues, every chain designed, random sequences) in pairs/s, with
each number of DataLoader workers (0: in the training process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
from torch.utils.data import DataLoader

from dpo_inv.data.batches import ExampleDataset, LengthGroupedSampler, collate
from dpo_inv.data.dataset import load_records
from dpo_inv.structures.parse import AMINO_ACIDS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PAIRS = [ROOT / "data" / "pairs" / "train.jsonl", ROOT / "data" / "pairs" / "val.jsonl"]


def proc_mb(key: str) -> float:
    """A `key: N kB` line of /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def scale_data(work_dir: Path, num_structures: int, num_pairs: int) -> Path:
    """The structures and pairs of the scale mode (made once), as a pairs file; with no pairs, a file of
    structure records (what SFT trains on), one per structure."""
    folder = work_dir / f"scale-{num_structures}-{num_pairs}"
    pairs_file = folder / ("pairs.jsonl" if num_pairs else "structures.jsonl")
    if pairs_file.is_file():
        return pairs_file
    chains = set()
    for path in EXAMPLE_PAIRS:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            chains.add(
                (
                    str((path.parent / record["pdb_file"]).resolve()),
                    record["chain_id"],
                    len(record["preferred_seq"]),
                )
            )
    chains = sorted(chains)
    (folder / "structures").mkdir(parents=True, exist_ok=True)
    structures = []
    for i in range(num_structures):
        source, chain, length = chains[i % len(chains)]
        link = folder / "structures" / f"{i:06d}_{Path(source).name}"
        if not link.exists():
            os.link(source, link)
        structures.append({"pdb_file": f"structures/{link.name}", "chain_id": chain, "length": length})
    rng = random.Random(0)
    tmp = pairs_file.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        if not num_pairs:
            for structure in structures:
                record = {"pdb_file": structure["pdb_file"], "chain_id": structure["chain_id"]}
                handle.write(json.dumps(record) + "\n")
        for i in range(num_pairs):
            structure = structures[i % num_structures]
            chosen, rejected = ("".join(rng.choices(AMINO_ACIDS, k=structure["length"])) for _ in range(2))
            record = {"pdb_file": structure["pdb_file"], "chain_id": structure["chain_id"],
                      "preferred_seq": chosen, "unpreferred_seq": rejected}  # fmt: skip
            handle.write(json.dumps(record) + "\n")
    tmp.rename(pairs_file)
    return pairs_file


def worker(args: argparse.Namespace) -> None:
    """One rank of a scale launch: the trainer's data loading up to its first batch."""
    from accelerate.utils import gather_object

    from dpo_inv.training.config import DPOConfig
    from dpo_inv.training.loading import load_data
    from dpo_inv.training.trainer import build_accelerator

    config = DPOConfig(
        output_dir=str(args.work_dir / "output"),
        train_file=str(args.train_file),
        loss_type=["sft"] if args.train_file.name == "structures.jsonl" else ["sigmoid"],
        cache_dir=str(args.cache_dir),
        dataset_num_proc=args.dataset_num_proc,
        report_to="none",
    )
    accelerator, _ = build_accelerator(config)
    start = time.perf_counter()
    data = load_data(accelerator, config)
    load_seconds = time.perf_counter() - start
    dataset = ExampleDataset(data.train)
    global_batch = config.per_device_train_batch_size * accelerator.num_processes
    sampler = LengthGroupedSampler(dataset.lengths, global_batch, config.seed)
    loader = accelerator.prepare(
        DataLoader(dataset, config.per_device_train_batch_size, sampler=sampler, collate_fn=collate)
    )
    next(iter(loader))
    rank = {
        "rank": accelerator.process_index,
        "load_data_seconds": round(load_seconds, 1),
        "first_batch_seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "parse_workers_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "rss_private_mb": round(proc_mb("RssAnon")),
        "rss_file_mb": round(proc_mb("RssFile")),
    }
    ranks = gather_object([rank])
    if accelerator.is_main_process:
        pairs = len(data.train.records) + (len(data.eval.records) if data.eval else 0)
        print(json.dumps({"at_first_batch": time.time(), "pairs": pairs,
                          "structures": len(data.train.structures), "ranks": ranks}))  # fmt: skip


def scale(args: argparse.Namespace) -> None:
    train_file = scale_data(args.work_dir, args.num_structures, args.num_pairs)
    for processes in args.processes:
        cache_dir = args.work_dir / f"cache-{args.num_structures}-{args.num_pairs}-{processes}"
        subprocess.run(["rm", "-rf", str(cache_dir)], check=True)
        for start in ("first", "cached"):
            launched = time.time()
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                       str(processes), __file__, "--worker", "--train_file", str(train_file), "--cache_dir",
                       str(cache_dir), "--work_dir", str(args.work_dir)]  # fmt: skip
            if args.dataset_num_proc is not None:
                command += ["--dataset_num_proc", str(args.dataset_num_proc)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
            report = json.loads(result.stdout.strip().splitlines()[-1])
            tables = {p.name.split("-")[0]: round(folder_mb(p)) for p in cache_dir.iterdir() if p.is_dir()}
            print(json.dumps({
                "start": start, "processes": processes, "dataset_num_proc": args.dataset_num_proc,
                "structures": report["structures"], "pairs": report["pairs"],
                "seconds_to_first_batch": round(report["at_first_batch"] - launched, 1),
                "cache_mb": tables, "ranks": report["ranks"],
            }), flush=True)  # fmt: skip


def loader(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchmark import length_pairs

    datasets.disable_progress_bars()
    base = ROOT / "data" / "structures" / "1BD2.cif.gz"
    for length in args.lengths:
        pairs_file = length_pairs(base, length, args.loader_pairs, args.work_dir, seed=0)
        data = load_records(pairs_file, cache_dir=args.work_dir / "cache-loader")
        dataset = ExampleDataset(data)
        for workers in args.dataloader_num_workers:
            batches = DataLoader(
                dataset, args.batch_size, shuffle=True, collate_fn=collate, num_workers=workers
            )
            iterator, pairs = iter(batches), 0
            for _ in range(workers * 2 + 1):  # workers started, their first batches made
                next(iterator)
            start = time.perf_counter()
            for batch in iterator:
                pairs += len(batch["index"])
            seconds = time.perf_counter() - start
            result = {"length": length, "batch_size": args.batch_size, "dataloader_num_workers": workers}
            print(json.dumps({**result, "pairs_per_second": round(pairs / seconds)}), flush=True)


def example(args: argparse.Namespace) -> None:
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as cache_dir:
        result = {"files": args.data, "dataset_num_proc": args.dataset_num_proc}
        for run in ("first", "cached"):
            start = time.perf_counter()
            loaded = [
                load_records(path, cache_dir=cache_dir, num_proc=args.dataset_num_proc) for path in args.data
            ]
            seconds = time.perf_counter() - start
            structures = sum(len(d.structures) for d in loaded)
            result.update({
                "pairs": sum(len(d.records) for d in loaded),
                "structures": structures,
                f"{run}_seconds": round(seconds, 3),
                f"{run}_structures_per_second": round(structures / seconds, 1),
            })  # fmt: skip
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", default=[str(p) for p in EXAMPLE_PAIRS])
    parser.add_argument("--dataset_num_proc", type=int, default=None,
                        help="processes parsing structures (default: one per CPU)")  # fmt: skip
    parser.add_argument("--num_structures", type=int, help="scale mode: structure files")
    parser.add_argument(
        "--num_pairs", type=int, default=1_000_000, help="scale mode: pairs (0: structure records)"
    )
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="scale mode: ranks per launch"
    )
    parser.add_argument("--loader", action="store_true", help="the loader alone")
    parser.add_argument("--lengths", type=int, nargs="+", default=[150, 600])
    parser.add_argument("--dataloader_num_workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--loader_pairs", type=int, default=4096)
    parser.add_argument("--work_dir", type=Path, default=ROOT / "outputs" / "benchmark_data")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train_file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache_dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
    elif args.loader:
        loader(args)
    elif args.num_structures:
        scale(args)
    else:
        example(args)


if __name__ == "__main__":
    main()
