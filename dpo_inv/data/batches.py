"""Batches for training and scoring: examples joined with their structure, padding, length-grouped order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from dpo_inv.data.dataset import SEQUENCE_COLUMNS, RecordSet
from dpo_inv.structures.parse import ALPHABET


class ExampleDataset(TorchDataset):
    """Map-style dataset of examples: one record joined with its structure's features. A DataLoader reads
    the examples of a batch together (`__getitems__`), from the memory-mapped Arrow tables."""

    def __init__(self, data: RecordSet) -> None:
        self.records = data.records.with_format("numpy")
        self.structures = data.structures.with_format("numpy")
        self.record_rows = data.records.with_format("arrow")
        self.structure_rows = data.structures.select_columns(list(BATCH_STRUCTURE_KEYS)).with_format("arrow")
        self.lengths = data.lengths()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        records = _values(self.record_rows[[int(i) for i in indices]])
        structures = _values(self.structure_rows[[int(i) for i in records["structure_id"]]])
        columns = {**records, **structures}
        return [
            {"index": int(index), **{name: values[row] for name, values in columns.items()}}
            for row, index in enumerate(indices)
        ]


def _values(table: pa.Table) -> dict[str, Sequence[Any]]:
    """Each column of `table` as one value per row, the rows of a list column as views of one copy of it."""
    out = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if pa.types.is_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False, writable=True)
            offsets = column.offsets.to_numpy()
            offsets = offsets - offsets[0]
            out[name] = [values[start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)]
        else:
            out[name] = column.to_numpy(zero_copy_only=False, writable=True)
    return out


BATCH_STRUCTURE_KEYS = (
    "X", "mask", "residue_idx", "chain_encoding", "design_mask", "native", "context_xyz", "context_element",
)  # fmt: skip
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # precomputed: training (asked), eval pairs
# The model's structure inputs (`ProteinMPNN.encode`) a batch may hold.
STRUCTURE_INPUTS = (
    "X", "mask", "residue_idx", "chain_encoding", "context_xyz", "context_element", "context_mask",
    "membrane_labels",
)  # fmt: skip


def structure_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The structure inputs of the model present in a batch, as keyword arguments of `encode`."""
    return {name: batch[name] for name in STRUCTURE_INPUTS if name in batch}


def collate(examples: list[dict[str, Any]], pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Pad a list of examples into a batch, to the longest structure (rounded up to a multiple of
    `pad_to_multiple_of`, so that batch shapes repeat). Designed residues come first in each structure.

    `loss_mask` marks designed, observed, mutable positions (where log p is summed); `decode_mask` marks
    the positions decoded after all others (designed and mutable), as ProteinMPNN orders fixed positions.
    The examples' sequences (`chosen` and `rejected` of pairs; `sequence`, and `wildtype` of variants) are
    the native sequence beyond the designed residues; `label` is there for labelled sequences,
    `chosen_scores` and `rejected_scores` (per-residue scores, zero-padded) when every example has them.
    Structures' ligand context atoms are padded to the batch's most (at least one, masked); membrane labels
    are there when an example has them.
    """
    B, L = len(examples), max(len(e["mask"]) for e in examples)
    if pad_to_multiple_of:
        L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
    unknown = ALPHABET.index("X")
    batch = {  # filled as numpy arrays, then shared with torch
        "X": np.zeros((B, L, 4, 3), np.float32),
        "mask": np.zeros((B, L), np.float32),
        "residue_idx": np.full((B, L), -100, np.int64),
        "chain_encoding": np.zeros((B, L), np.int64),
        "decode_mask": np.zeros((B, L), np.float32),
        "loss_mask": np.zeros((B, L), np.float32),
        "native": np.full((B, L), unknown, np.int64),
        **{name: np.full((B, L), unknown, np.int64) for name in SEQUENCE_COLUMNS if name in examples[0]},
        "weight": np.array([e.get("weight", 1.0) for e in examples], np.float32),
        "index": np.array([e["index"] for e in examples], np.int64),
        "length": np.array([len(e["mask"]) for e in examples], np.int64),
    }
    if "label" in examples[0]:
        batch["label"] = np.array([e["label"] for e in examples], np.int64)
    for name in REFERENCE_COLUMNS:
        if name in examples[0]:
            batch[name] = np.array([e[name] for e in examples], np.float32)
    if all(len(e.get("chosen_scores", ())) for e in examples):
        for name in ("chosen_scores", "rejected_scores"):
            batch[name] = np.zeros((B, L), np.float32)
            for i, e in enumerate(examples):
                batch[name][i, : len(e[name])] = e[name]
    if any("context_element" in e for e in examples):
        _collate_context(batch, examples)
    if any(len(e.get("membrane_labels", ())) for e in examples):
        batch["membrane_labels"] = np.zeros((B, L), np.int64)
        for i, e in enumerate(examples):
            labels = e.get("membrane_labels", ())
            batch["membrane_labels"][i, : len(labels)] = labels
    for i, e in enumerate(examples):
        n, d = len(e["mask"]), len(e["mutable"])
        batch["X"][i, :n] = np.reshape(e["X"], (n, 4, 3))
        batch["mask"][i, :n] = e["mask"]
        batch["residue_idx"][i, :n] = e["residue_idx"]
        batch["chain_encoding"][i, :n] = e["chain_encoding"]
        batch["decode_mask"][i, :d] = e["mutable"]
        batch["loss_mask"][i, :d] = batch["decode_mask"][i, :d] * batch["mask"][i, :d]
        batch["native"][i, :n] = e["native"]
        for name in SEQUENCE_COLUMNS:
            if name in batch:
                batch[name][i, :n] = e["native"]
                batch[name][i, : len(e[name])] = e[name]  # the designed chains, or the whole structure
    return {name: torch.from_numpy(values) for name, values in batch.items()}


def _collate_context(batch: dict[str, np.ndarray], examples: list[dict[str, Any]]) -> None:
    B, A = len(examples), max(1, *(len(e.get("context_element", ())) for e in examples))
    batch["context_xyz"] = np.zeros((B, A, 3), np.float32)
    batch["context_element"] = np.zeros((B, A), np.int64)
    batch["context_mask"] = np.zeros((B, A), np.float32)
    for i, e in enumerate(examples):
        element = e.get("context_element", ())
        a = len(element)
        batch["context_xyz"][i, :a] = np.reshape(e["context_xyz"], (a, 3))
        batch["context_element"][i, :a] = element
        batch["context_mask"][i, :a] = 1.0


class LengthGroupedSampler(Sampler[int]):
    """Shuffled indices where consecutive `batch_size` chunks have similar lengths (less padding).

    Reproducible per (seed, epoch): call `set_epoch` before each epoch. Lengths and order are held as numpy
    arrays, not as a Python object per example.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = get_length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        return iter(np.asarray(order))


class LengthSortedSampler(Sampler[int]):
    """Indices from the longest example to the shortest, examples of equal length in a new random order for
    each (seed, epoch): call `set_epoch` before each epoch."""

    def __init__(self, lengths: Sequence[int], seed: int) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_generator(self) -> torch.Generator:
        """The epoch's random numbers: the order of equal lengths, then whatever the caller draws. (Not named
        `generator`: Accelerate takes a sampler's `generator` for a torch.Generator to synchronise.)"""
        return torch.Generator().manual_seed(self.seed + self.epoch)

    def order(self, generator: torch.Generator) -> np.ndarray:
        shuffled = torch.randperm(len(self.lengths), generator=generator).numpy()
        return shuffled[np.argsort(-self.lengths[shuffled], kind="stable")]

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch_generator()))


class ResidueBatchSampler(Sampler[list[int]]):
    """Micro-batches measured in residues, as ProteinMPNN's own training batches are (about 10,000): each
    holds as many examples as fit `budget`, counted as memory grows: examples × the longest (padded) length.
    An example longer than the budget is a micro-batch alone.

    As ProteinMPNN's loader does, the examples are sorted by length (equal lengths in a new order each epoch)
    and cut into batches, which come in a new order each epoch (the one with the longest structure first,
    so that a device too small for it fails at once). With `num_processes` > 1 the batches are global ones:
    `num_processes` micro-batches in a row, one per rank (Accelerate deals rank r the r-th of each), with the
    same number of examples (the collectives of a step need that) of similar lengths (taken in turn from the
    sorted examples), each within `budget`. Where the last global batch's examples do not divide evenly among
    the ranks, it is filled up with repeats of its own examples (fewer than `num_processes`), as Accelerate
    fills the last batch of `per_device_train_batch_size` pairs. The batches are a function of the lengths,
    the seed and the epoch (`set_epoch`, also reached through `sampler` as Accelerate's data loaders do), and
    their number is the same in every epoch.
    """

    def __init__(self, lengths: Sequence[int], budget: int, seed: int, num_processes: int = 1) -> None:
        self.sampler = LengthSortedSampler(lengths, seed)
        self.budget = budget
        self.num_processes = num_processes
        self.sizes = self._plan()  # examples per micro-batch, for each global batch

    def _plan(self) -> list[int]:
        """Greedy over the lengths, longest first: a global batch of micro-batches of budget // its longest
        length examples; its number of examples does not depend on the order of equal lengths."""
        lengths, ranks = np.sort(self.sampler.lengths)[::-1], self.num_processes
        sizes, start = [], 0
        while start < len(lengths):
            size = max(1, self.budget // int(lengths[start]))
            sizes.append(min(size, -(-(len(lengths) - start) // ranks)))
            start += size * ranks
        return sizes

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sizes) * self.num_processes

    def __iter__(self) -> Iterator[list[int]]:
        generator = self.sampler.epoch_generator()
        order, ranks = self.sampler.order(generator), self.num_processes
        batches, start = [], 0
        for size in self.sizes:
            batches.append(np.resize(order[start : start + size * ranks], size * ranks))  # the last: repeats
            start += size * ranks
        if not batches:
            return
        for g in [0, *(1 + torch.randperm(len(batches) - 1, generator=generator)).tolist()]:
            for rank in range(ranks):
                yield batches[g][rank::ranks].tolist()
