"""The data of a training run: validated and cached by rank 0, read by the others from the cache; the eval
split; the reference's log-probabilities computed once when asked."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader

from dpo_inv.data.batches import REFERENCE_COLUMNS, ExampleDataset, collate
from dpo_inv.data.dataset import (
    LABELLED,
    PAIRS,
    STRUCTURES,
    VARIANTS,
    RecordSet,
    column,
    load_records,
    load_saved_records,
)
from dpo_inv.data.featurized import context_counts
from dpo_inv.data.progress import progress
from dpo_inv.data.records import Data, DataError, data_name, read_records, write_jsonl
from dpo_inv.errors import BadInput
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.variants import LabelledVariants, variant_labels
from dpo_inv.models.weights import model_parse_options
from dpo_inv.structures.context import empty_context_note
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.exits import EXIT_BAD_INPUT
from dpo_inv.training.launch import say
from dpo_inv.training.loss import batch_ranks, pair_logps
from dpo_inv.training.objective import policy_precision
from dpo_inv.training.stopping import TrainingStopped


@dataclass(frozen=True)
class RunData:
    """The training data, the eval pairs and the labelled eval variants (None when not given)."""

    train: RecordSet
    eval: RecordSet | None = None
    variants: LabelledVariants | None = None


def split_by_structure(data: RecordSet, fraction: float, seed: int) -> tuple[RecordSet, RecordSet | None]:
    """Hold out a seeded fraction of the structures with all their pairs (no structure in both splits);
    nothing from a single structure, which `data_notes` announces."""
    structure_ids = column(data.records, "structure_id")
    unique = np.unique(structure_ids)
    if len(unique) == 1:
        return data, None
    num_eval = max(1, round(fraction * len(unique)))
    if num_eval >= len(unique):
        raise DataError(
            f"{data.source}: eval_split={fraction} leaves no training structure out of {len(unique)}; lower "
            "eval_split or give an eval_file"
        )
    held_out = np.random.default_rng(seed).choice(unique, size=num_eval, replace=False)
    is_eval = np.isin(structure_ids, held_out)
    train = RecordSet(data.records.select(np.flatnonzero(~is_eval)), data.structures, data.source)
    evaluation = RecordSet(data.records.select(np.flatnonzero(is_eval)), data.structures, data.source)
    return train, evaluation


def load_data(
    accelerator: Accelerator,
    config: DPOConfig,
    train_dataset: Data | None = None,
    eval_dataset: Data | None = None,
) -> RunData:
    """Rank 0 validates the data (the files of `config`, or the datasets given instead of them) and parses
    their structures into the Arrow cache, before training; the other ranks then read its result from
    there. Bad input stops every rank, rank 0 reporting it.
    """
    train = config.train_file if train_dataset is None else train_dataset
    evaluation = config.eval_file if eval_dataset is None else eval_dataset
    sources = {"train_dataset": train, **({"eval_dataset": evaluation} if evaluation is not None else {})}
    options = {
        "structure_roots": config.structure_root or (),
        "on_bad_record": config.on_bad_record,
        "kind": {"pairs": PAIRS, "labelled": LABELLED, "structures": STRUCTURES}[config.record_kind],
        "require_residue_scores": "residpo" in config.loss_type,
    }
    loaded: list[RecordSet] = []
    variants: LabelledVariants | None = None
    failure: Exception | None = None
    if accelerator.is_main_process:
        try:
            loaded, variants = validate(config, sources, options)
            splits = train_and_eval(config, loaded)  # an impossible eval_split fails here, on rank 0 alone
        except Exception as err:  # raised below, once the other ranks know
            failure = err
    # the cache folders of the validated data (and the variant labels), or the exit status of the others
    outcome: tuple | int = (
        [data.files for data in loaded],
        variants and (variants.data.files, variants.labels),
    )
    if failure is not None:
        bad_path = isinstance(failure, OSError) and failure.filename is not None
        outcome = EXIT_BAD_INPUT if isinstance(failure, BadInput) or bad_path else 1
    (outcome,) = broadcast_object_list([outcome])
    if failure is not None:
        raise failure
    if isinstance(outcome, int):
        raise TrainingStopped("rank 0 could not load the data", outcome)
    if accelerator.is_main_process:
        write_skipped(accelerator, config, loaded)
        return RunData(*splits, variants)
    files, saved_variants = outcome
    names = [data_name(data, name) for name, data in sources.items()]
    saved = [load_saved_records(f, name) for f, name in zip(files, names, strict=True)]
    if saved_variants is not None:
        variants = LabelledVariants(
            load_saved_records(saved_variants[0], config.eval_variants_file), saved_variants[1]
        )
    return RunData(*train_and_eval(config, saved), variants)


def validate(
    config: DPOConfig, sources: dict[str, Data], options: dict
) -> tuple[list[RecordSet], LabelledVariants | None]:
    """Load and check the training and eval data; one `DataError` reports the bad records of all of them."""
    loaded, errors, variants = [], [], None
    options["options"] = model_parse_options(
        config.model_name_or_path, config.ref_model_name_or_path, config.ligand_context, config.ligand_exclude
    )
    for name, data in sources.items():
        try:
            loaded.append(load_records(data, config.cache_dir, config.dataset_num_proc, name=name, **options))
        except DataError as err:
            errors.append(str(err))
    if config.eval_variants_file:
        try:
            data = load_records(
                config.eval_variants_file,
                config.cache_dir,
                config.dataset_num_proc,
                kind=VARIANTS,
                structure_roots=options["structure_roots"],
                options=options["options"],
            )
            variants = LabelledVariants(data, variant_labels(config.eval_variants_file))
        except DataError as err:
            errors.append(str(err))
    if errors:
        raise DataError("\n".join(errors))
    note = empty_context_note(context_counts(loaded[0].structures), options["options"])
    if note:
        print(f"Note: {note}", flush=True)
    return loaded, variants


def train_and_eval(config: DPOConfig, loaded: list[RecordSet]) -> tuple[RecordSet, RecordSet | None]:
    """The training and eval data: the two files, or eval_split held out of the one."""
    if len(loaded) == 2:
        return loaded[0], loaded[1]
    if config.eval_split > 0:
        return split_by_structure(loaded[0], config.eval_split, config.seed)
    return loaded[0], None


def write_skipped(accelerator: Accelerator, config: DPOConfig, loaded: list[RecordSet]) -> None:
    """With on_bad_record=skip: list the records left out, with their reasons, in skipped.jsonl."""
    skipped = [record for data in loaded for record in data.skipped]
    if not skipped:
        return
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "skipped.jsonl", "w") as handle:
        for record in skipped:
            handle.write(json.dumps(asdict(record), default=str) + "\n")
    say(
        accelerator,
        f"Skipped {len(skipped)} bad record(s) of {', '.join(data.source for data in loaded)}; each is "
        f"listed with its reason in {output_dir / 'skipped.jsonl'}",
    )


@torch.no_grad()
def precompute_reference(
    accelerator: Accelerator, reference: ProteinMPNN, data: RecordSet, config: DPOConfig
) -> RecordSet:
    """Score every pair with the reference once (sharded over ranks, gathered) and store the log-probs,
    computed in the policy's precision (its autocast, as in training)."""
    loader = accelerator.prepare(
        DataLoader(
            ExampleDataset(data),
            batch_size=config.per_device_eval_batch_size,
            collate_fn=partial(collate, pad_to_multiple_of=config.pad_to_multiple_of),
        )
    )
    chosen, rejected = [], []
    for batch in progress(loader, desc="Reference log-probs", disable=not accelerator.is_main_process):
        with policy_precision(accelerator):
            logps = pair_logps(
                reference,
                batch,
                batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order),
            )
        gathered = accelerator.gather_for_metrics(torch.stack([logps.chosen, logps.rejected], dim=-1))
        chosen.append(gathered[:, 0].cpu())
        rejected.append(gathered[:, 1].cpu())
    records = data.records
    for name, values in zip(REFERENCE_COLUMNS, (chosen, rejected), strict=True):
        records = records.add_column(name, torch.cat(values).tolist())
    return RecordSet(records, data.structures, data.source)


def save_in_memory(accelerator: Accelerator, config: DPOConfig, name: str, data: Data) -> str:
    """Records given in memory, saved by rank 0 as OUTPUT_DIR/NAME.jsonl with absolute structure paths, so
    that the run's config.yaml names data the command line can train on again; returns that path."""
    path = Path(config.output_dir) / f"{name}.jsonl"
    if accelerator.is_main_process:
        rows = []
        for record in read_records(data, name):
            row = dict(record.data)
            for key in ("pdb_file", "structure"):
                if isinstance(row.get(key), str):
                    row[key] = str(Path(row[key]).resolve())
            rows.append(row)
        write_jsonl(path, rows)
    return str(path)
