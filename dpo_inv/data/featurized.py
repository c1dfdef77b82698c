"""Structure features of (structure file, designed chains, fixed chains) keys, parsed once and cached as
Arrow."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import datasets
import numpy as np

from dpo_inv.data.progress import progress, quiet_datasets
from dpo_inv.data.saved import load_cached, load_saved, save_atomically
from dpo_inv.structures.context import context_atoms
from dpo_inv.structures.parse import (
    PROTEINMPNN_PARSE,
    ParseOptions,
    StructureError,
    featurize,
    protein_chains,
    read_model,
)

PARSE_CHUNK = 512  # structures parsed by each process between two progress updates
MIN_STRUCTURES_PER_PROCESS = 64  # fewer are parsed in one process: starting others would cost more
FEATURES_VERSION = "5"  # bump when the stored features change


def _featurize_structure(row: dict, options: ParseOptions) -> dict:
    """`datasets.map` function: parse and featurize one (structure, chains); errors are stored, not raised."""
    out = {"error": "", "length": 0, "num_designed": 0, "num_context_atoms": 0}
    empty = {
        "X": np.zeros(0, np.float32),
        "mask": np.zeros(0, np.float32),
        "residue_idx": np.zeros(0, np.int32),
        "chain_encoding": np.zeros(0, np.int32),
        "design_mask": np.zeros(0, np.float32),
        "native": np.zeros(0, np.int8),
        "residue_ids": [],
        "context_xyz": np.zeros(0, np.float32),
        "context_element": np.zeros(0, np.int8),
    }
    try:
        model = read_model(row["path"])
        chains = protein_chains(model, row["path"], options)
        design = row["design_chains"] or [next(iter(chains))]
        features = featurize(chains, design, row["fixed_chains"], row["path"])
    except StructureError as err:
        return {**out, **empty, "error": str(err)}
    context = context_atoms(model, options)
    return {
        **out,
        "X": features.X.reshape(-1),
        "mask": features.mask,
        "residue_idx": features.residue_idx.astype(np.int32),
        "chain_encoding": features.chain_encoding.astype(np.int32),
        "design_mask": features.design_mask,
        "native": features.native.astype(np.int8),
        "residue_ids": [f"{c}{n}" for c in [*design, *row["fixed_chains"]] for n in chains[c].numbers],
        "context_xyz": context.xyz.reshape(-1),
        "context_element": context.element,
        "length": len(features.mask),
        "num_designed": int(features.design_mask.sum()),
        "num_context_atoms": len(context),
        "design_chains": design,
    }


STRUCTURE_FEATURES = datasets.Features(
    {
        "path": datasets.Value("string"),
        "design_chains": datasets.Sequence(datasets.Value("string")),
        "fixed_chains": datasets.Sequence(datasets.Value("string")),
        "error": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "num_designed": datasets.Value("int32"),
        "num_context_atoms": datasets.Value("int32"),
        "X": datasets.Sequence(datasets.Value("float32")),
        "mask": datasets.Sequence(datasets.Value("float32")),
        "residue_idx": datasets.Sequence(datasets.Value("int32")),
        "chain_encoding": datasets.Sequence(datasets.Value("int32")),
        "design_mask": datasets.Sequence(datasets.Value("float32")),
        "native": datasets.Sequence(datasets.Value("int8")),
        "residue_ids": datasets.Sequence(datasets.Value("string")),  # chain + author number, e.g. "A52A"
        "context_xyz": datasets.Sequence(datasets.Value("float32")),  # ligand context atoms, flattened
        "context_element": datasets.Sequence(datasets.Value("int8")),  # their atomic numbers
    }
)


Keys = Sequence[tuple[str, Sequence[str], Sequence[str]]]  # (structure file, designed chains, fixed chains)


def _fingerprint(keys: Keys, options: ParseOptions) -> str:
    """Hash of the structure keys, the parse options and each file's size and modification time: a changed
    file invalidates."""
    digest = hashlib.sha256(json.dumps([FEATURES_VERSION, dataclasses.astuple(options)]).encode())
    for path, design, fixed in keys:
        stat = Path(path).stat()
        digest.update(json.dumps([path, design, fixed, stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()[:20]


def context_counts(structures: datasets.Dataset) -> dict[str, int]:
    """Structure file name -> number of ligand context atoms, for `context.empty_context_note`."""
    paths, counts = structures["path"], structures["num_context_atoms"]
    return {Path(path).name: count for path, count in zip(paths, counts, strict=True)}


def cache_root(cache_dir: str | Path | None) -> Path:
    """The folder of the cached tables: `cache_dir`, else dpo_inv/ in the `datasets` cache."""
    return Path(cache_dir) if cache_dir else Path(datasets.config.HF_DATASETS_CACHE) / "dpo_inv"


def is_current(structures: datasets.Dataset, folder: Path, options: ParseOptions) -> bool:
    """Whether the cached table `structures` (saved in `folder`) still holds what its structure files,
    read with `options`, give: none of them changed or missing since."""
    keys = zip(structures["path"], structures["design_chains"], structures["fixed_chains"], strict=True)
    try:
        return folder.name == f"structures-{_fingerprint(list(keys), options)}"
    except OSError:
        return False


def parse_processes(num_proc: int | None, num_structures: int) -> int:
    """How many processes parse `num_structures`: `num_proc`, by default one per CPU this process may use,
    each given at least MIN_STRUCTURES_PER_PROCESS."""
    if num_proc is None:
        num_proc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(num_proc, num_structures // MIN_STRUCTURES_PER_PROCESS))


def build_structures(
    keys: Keys,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    options: ParseOptions = PROTEINMPNN_PARSE,
) -> tuple[datasets.Dataset, Path, bool]:
    """Features of each structure key, parsed once (in `parse_processes` processes) and cached as Arrow;
    returns (table, its folder, loaded_from_cache). A structure that cannot be used is kept as a row with
    its `error`."""
    target = cache_root(cache_dir) / f"structures-{_fingerprint(keys, options)}"
    cached = load_cached(target)
    if cached is not None:
        return cached, target, True
    keys_table = {
        "path": [k[0] for k in keys],
        "design_chains": [list(k[1]) for k in keys],
        "fixed_chains": [list(k[2]) for k in keys],
    }  # typed: a column of empty lists would otherwise be read as nulls, which no feature can follow
    table = datasets.Dataset.from_dict(
        keys_table, features=datasets.Features({name: STRUCTURE_FEATURES[name] for name in keys_table})
    )
    parts, processes = [], parse_processes(num_proc, len(keys))
    chunk_size = PARSE_CHUNK * processes
    with quiet_datasets(), progress(total=len(keys), desc="Parsing structures", unit="structure",
                                    disable=len(keys) <= chunk_size) as bar:  # fmt: skip
        for start in range(0, len(keys), chunk_size):
            chunk = table.select(range(start, min(start + chunk_size, len(keys))))
            parts.append(
                chunk.map(
                    _featurize_structure,
                    fn_kwargs={"options": options},
                    features=STRUCTURE_FEATURES,
                    num_proc=min(processes, len(chunk)) if processes > 1 else None,
                    keep_in_memory=True,
                )
            )
            bar.update(len(chunk))
        save_atomically(datasets.concatenate_datasets(parts), target)
    return load_saved(target), target, False
