"""Batches for training and scoring: examples joined with their structure, padding, length-grouped order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from dpo_inv.data.dataset import PairDataset
from dpo_inv.structures.parse import ALPHABET


class PreferenceDataset(TorchDataset):
    """Map-style dataset of examples: one pair joined with its structure's features."""

    def __init__(self, data: PairDataset) -> None:
        self.pairs = data.pairs.with_format("numpy")
        self.structures = data.structures.with_format("numpy")
        self.lengths = np.asarray(data.structures["length"])[np.asarray(data.pairs["structure_id"])]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.pairs[int(index)]
        structure = self.structures[int(pair["structure_id"])]
        return {"index": int(index), **pair, **{k: structure[k] for k in BATCH_STRUCTURE_KEYS}}


BATCH_STRUCTURE_KEYS = (
    "X", "mask", "residue_idx", "chain_encoding", "design_mask", "native", "context_xyz", "context_element",
)  # fmt: skip
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # with precompute_ref_log_probs
# The model's structure inputs (`ProteinMPNN.encode`) a batch may hold.
STRUCTURE_INPUTS = (
    "X", "mask", "residue_idx", "chain_encoding", "context_xyz", "context_element", "context_mask",
    "membrane_labels",
)  # fmt: skip


def structure_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The structure inputs of the model present in a batch, as keyword arguments of `encode`."""
    return {name: batch[name] for name in STRUCTURE_INPUTS if name in batch}


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad a list of examples into a batch. Designed residues come first in each structure.

    `loss_mask` marks designed, observed, mutable positions (where log p is summed); `decode_mask` marks
    the positions decoded after all others (designed and mutable), as ProteinMPNN orders fixed positions.
    `label` is 1 for a pair or a desirable sequence; `chosen_scores` and `rejected_scores` (per-residue
    scores, zero-padded) are there when every example has them. Structures' ligand context atoms are padded
    to the batch's most (at least one, masked); membrane labels are there when an example has them.
    """
    B, L = len(examples), max(len(e["mask"]) for e in examples)
    batch = {
        "X": torch.zeros(B, L, 4, 3),
        "mask": torch.zeros(B, L),
        "residue_idx": torch.full((B, L), -100, dtype=torch.long),
        "chain_encoding": torch.zeros(B, L, dtype=torch.long),
        "decode_mask": torch.zeros(B, L),
        "loss_mask": torch.zeros(B, L),
        "native": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "chosen": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "rejected": torch.full((B, L), ALPHABET.index("X"), dtype=torch.long),
        "weight": torch.tensor([float(e["weight"]) for e in examples]),
        "label": torch.tensor([int(e.get("label", 1)) for e in examples], dtype=torch.long),
        "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        "length": torch.tensor([len(e["mask"]) for e in examples], dtype=torch.long),
    }
    for name in REFERENCE_COLUMNS:
        if name in examples[0]:
            batch[name] = torch.tensor([float(e[name]) for e in examples])
    if all(len(e.get("chosen_scores", ())) for e in examples):
        for name in ("chosen_scores", "rejected_scores"):
            batch[name] = torch.zeros(B, L)
            for i, e in enumerate(examples):
                batch[name][i, : len(e[name])] = torch.from_numpy(np.asarray(e[name], dtype=np.float32))
    if any("context_element" in e for e in examples):
        _collate_context(batch, examples)
    if any(len(e.get("membrane_labels", ())) for e in examples):
        batch["membrane_labels"] = torch.zeros(B, L, dtype=torch.long)
        for i, e in enumerate(examples):
            labels = np.asarray(e.get("membrane_labels", ()), dtype=np.int64)
            batch["membrane_labels"][i, : len(labels)] = torch.from_numpy(labels)
    for i, e in enumerate(examples):
        n, d = len(e["mask"]), len(e["chosen"])
        mask = torch.from_numpy(np.asarray(e["mask"], dtype=np.float32))
        native = torch.from_numpy(np.asarray(e["native"], dtype=np.int64))
        mutable = torch.from_numpy(np.asarray(e["mutable"], dtype=np.float32))
        batch["X"][i, :n] = torch.from_numpy(np.asarray(e["X"], dtype=np.float32).reshape(n, 4, 3))
        batch["mask"][i, :n] = mask
        batch["residue_idx"][i, :n] = torch.from_numpy(np.asarray(e["residue_idx"], dtype=np.int64))
        batch["chain_encoding"][i, :n] = torch.from_numpy(np.asarray(e["chain_encoding"], dtype=np.int64))
        batch["decode_mask"][i, :d] = mutable
        batch["loss_mask"][i, :d] = mutable * mask[:d]
        batch["native"][i, :n] = native
        for name in ("chosen", "rejected"):
            batch[name][i, :n] = native
            batch[name][i, :d] = torch.from_numpy(np.asarray(e[name], dtype=np.int64))
    return batch


def _collate_context(batch: dict[str, torch.Tensor], examples: list[dict[str, Any]]) -> None:
    B, A = len(examples), max(1, *(len(e.get("context_element", ())) for e in examples))
    batch["context_xyz"] = torch.zeros(B, A, 3)
    batch["context_element"] = torch.zeros(B, A, dtype=torch.long)
    batch["context_mask"] = torch.zeros(B, A)
    for i, e in enumerate(examples):
        element = np.asarray(e.get("context_element", ()), dtype=np.int64)
        a = len(element)
        batch["context_xyz"][i, :a] = torch.from_numpy(np.asarray(e["context_xyz"], np.float32).reshape(a, 3))
        batch["context_element"][i, :a] = torch.from_numpy(element)
        batch["context_mask"][i, :a] = 1.0


class LengthGroupedSampler(Sampler[int]):
    """Shuffled indices where consecutive `batch_size` chunks have similar lengths (less padding).

    Reproducible per (seed, epoch): call `set_epoch` before each epoch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))
