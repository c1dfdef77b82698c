"""`python -m dpo_inv.score`: log-probabilities of preference pairs or of sequences under a model.

    python -m dpo_inv.score --model outputs/example/final --reference vanilla/v_48_020 \\
        --data data/pairs/val.jsonl --output scores.jsonl

Pairs get `preferred_logp`, `unpreferred_logp` (and, with a reference, `preferred_reward`,
`unpreferred_reward`); sequences (`sequence`, optional `label`, `wildtype_seq`) get `logp`,
`logp_per_residue` (and `delta_logp`). A summary JSON line goes to stdout.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import HfArgumentParser

from dpo_inv.data import (
    PAIR_FIELDS,
    SEQUENCE_FIELDS,
    DataError,
    PreferenceDataset,
    collate,
    load_pairs,
    load_records,
)
from dpo_inv.launch import resolve_device
from dpo_inv.loss import PairLogps, batch_ranks, pair_logps
from dpo_inv.model import ProteinMPNN, load_model
from dpo_inv.structure import StructureError


@dataclass
class ScoreConfig:
    data: str = field(
        metadata={"help": "Preference pairs, or sequences (sequence, optional label, wildtype_seq)."}
    )
    output: str = field(metadata={"help": "Output JSONL: the input records with scores added."})
    model: str = field(
        default="vanilla/v_48_020", metadata={"help": "Model name, .pt file or saved directory."}
    )
    reference: str | None = field(
        default=None, metadata={"help": "Reference model: adds rewards (log p - log p_ref)."}
    )
    decoding_order: Literal["random", "left_to_right"] = field(
        default="random", metadata={"help": "random (seeded per record, as the trainer) or left_to_right."}
    )
    num_orders: int = field(default=1, metadata={"help": "Decoding orders per record; log p is averaged."})
    seed: int = field(
        default=42, metadata={"help": "Seed of the random decoding orders (the trainer's seed)."}
    )
    batch_size: int = field(default=16, metadata={"help": "Records per batch."})
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda, xpu, ...; default: the best available."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for parsed structures."})


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties get their average rank)."""

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        ranked = np.empty(len(x))
        ranked[order] = np.arange(len(x))
        _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
        return (np.bincount(inverse, ranked) / counts)[inverse]

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


@torch.no_grad()
def score_dataset(
    models: list[ProteinMPNN], dataset: PreferenceDataset, config: ScoreConfig, device: torch.device
) -> list[PairLogps]:
    """Summed log p of both sequences of every record under each model, with the same decoding orders."""
    loader = DataLoader(dataset, batch_size=config.batch_size, collate_fn=collate)
    results = [[] for _ in models]
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        ranks = batch_ranks(batch, config.seed, config.num_orders, config.decoding_order)
        for model, result in zip(models, results, strict=True):
            result.append(pair_logps(model, batch, ranks))
    return [
        PairLogps(
            *(
                torch.cat([getattr(r, name) for r in result]).cpu()
                for name in ("chosen", "rejected", "num_positions")
            )
        )
        for result in results
    ]


def score(config: ScoreConfig) -> dict:
    """Score every record of `config.data`, write `config.output`, return the summary."""
    rows = [record.data or {} for record in load_records(config.data)]
    columns = {name for row in rows for name in row}
    is_pairs = not ("sequence" in columns and "preferred_seq" not in columns)
    data = load_pairs(config.data, config.cache_dir, fields=PAIR_FIELDS if is_pairs else SEQUENCE_FIELDS)
    device = resolve_device(config.device)
    names = [config.model] + ([config.reference] if config.reference else [])
    models = [load_model(name).to(device).eval() for name in names]
    policy, *reference = score_dataset(models, PreferenceDataset(data), config, device)

    summary: dict = {"count": len(rows), "model": config.model, "reference": config.reference}
    if is_pairs:
        for i, row in enumerate(rows):
            row.update(preferred_logp=float(policy.chosen[i]), unpreferred_logp=float(policy.rejected[i]))
        margin = policy.chosen - policy.rejected
        if reference:
            chosen_reward, rejected_reward = (
                policy.chosen - reference[0].chosen,
                policy.rejected - reference[0].rejected,
            )
            for i, row in enumerate(rows):
                row.update(
                    preferred_reward=float(chosen_reward[i]), unpreferred_reward=float(rejected_reward[i])
                )
            margin = chosen_reward - rejected_reward
        summary.update(accuracy=float((margin > 0).float().mean()), mean_margin=float(margin.mean()))
        summary["accuracy_by"] = "reward" if reference else "logp"
    else:
        has_wildtype = "wildtype_seq" in columns
        delta = policy.chosen - policy.rejected
        for i, row in enumerate(rows):
            row.update(
                logp=float(policy.chosen[i]),
                logp_per_residue=float(policy.chosen[i] / policy.num_positions[i]),
            )
            if has_wildtype and row.get("wildtype_seq"):
                row["delta_logp"] = float(delta[i])
        if "label" in columns:
            key = "delta_logp" if has_wildtype else "logp"
            labelled = [
                (row[key], row["label"]) for row in rows if row.get("label") is not None and key in row
            ]
            if len(labelled) > 1:
                values, labels = np.array(labelled, dtype=np.float64).T
                summary.update(spearman=spearman(values, labels), spearman_of=key, labelled=len(labelled))
    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    with open(config.output, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return summary


def main(args: list[str] | None = None) -> None:
    (config,) = HfArgumentParser(ScoreConfig).parse_args_into_dataclasses(args)
    datasets.disable_progress_bars()
    try:
        summary = score(config)
    except (DataError, StructureError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
