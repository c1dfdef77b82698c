"""Scoring preference pairs and sequences under a model: `dpo-inv score` in Python, and what
`python -m dpo_inv score` computes."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import PAIRS, VARIANTS, column, load_records, normalise
from dpo_inv.data.featurized import context_counts
from dpo_inv.data.proteingym import StructureOptions, complete_records
from dpo_inv.data.records import (
    Data,
    DataError,
    as_table,
    data_name,
    raise_bad_records,
    read_records,
    rebase_paths,
    records_folder,
    write_jsonl,
)
from dpo_inv.errors import OptionError
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.options import ModelOptions, ScoringOrderOptions, check_signs
from dpo_inv.models.variants import (
    conditional_deltas,
    group_variants,
    joint_deltas_of,
    mean_and_median,
    round_metric,
    spearman,
    spearman_by_structure,
)
from dpo_inv.models.weights import as_model, load_model, shared_parse_options
from dpo_inv.structures.context import empty_context_note
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.ridge import AugmentedRidge, model_fingerprint
from dpo_inv.training.launch import resolve_device
from dpo_inv.training.loss import PairLogps, SequenceLogps, batch_ranks, sequence_logps

if TYPE_CHECKING:
    import pandas


@dataclass
class ScoreFiles:
    """What `python -m dpo_inv score` reads and writes."""

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
    per_structure_output: str | None = field(
        default=None,
        metadata={"help": "JSONL: one line per structure with its number of labelled records and Spearman."},
    )


@dataclass(kw_only=True)
class ScoreOptions(StructureOptions, ModelOptions, ScoringOrderOptions):
    """How records are scored: the options of `score` in Python, and the command's besides its files."""

    variant_scoring: Literal["conditional", "joint", "full"] | None = field(
        default=None,
        metadata={
            "help": "Sequences with a wildtype_seq: conditional (each substituted position decoded last, "
            "given every other residue; a multi-mutant the sum over its substitutions; one encoder pass "
            "per structure; delta_logp only), joint (the substituted positions decoded last, each given "
            "those already placed, averaged over up to 4 orders of them; the same on single mutants) or "
            "full (log p of the whole variant minus that of the wild type, under the same decoding order). "
            "Default: conditional, or with --ridge the estimator it was fitted on."
        },
    )
    score_field: str = field(
        default="label",
        metadata={"help": "The record field holding the measured label (e.g. ProteinGym's DMS_score); its "
                  "Spearman with the score is reported."},
    )  # fmt: skip
    lower_is_better: bool = field(default=False, metadata={"help": "Lower labels are better (e.g. ΔΔG)."})
    ridge: str | None = field(
        default=None,
        metadata={
            "help": "The augmented_ridge.json dpo-inv adapt wrote beside its final model (--model): adds "
            "predicted_<label field>, the augmented ridge model on delta_logp, to each variant of the "
            "proteins it was fitted on; the Spearman reported is then of that prediction."
        },
    )
    beta: float = field(
        default=0.1,
        metadata={"help": "Pairs with a --reference: rewards are beta · (policy − reference log p), as "
                  "TRL's; give the training run's beta to compare with the margin it logged."},
    )  # fmt: skip
    num_orders: int = field(default=1, metadata={"help": "Decoding orders per record; log p is averaged."})
    seed: int = field(
        default=42, metadata={"help": "Seed of the random decoding orders (the trainer's seed)."}
    )
    batch_size: int = field(default=16, metadata={"help": "Records per batch."})

    def __post_init__(self) -> None:
        check_signs(self, positive=("num_orders", "batch_size", "beta"), non_negative=("seed",))


@dataclass
class ScoreConfig(ScoreOptions, ScoreFiles):
    """`python -m dpo_inv score`: its files, then its options."""


@torch.no_grad()
def score_dataset(
    models: list[ProteinMPNN],
    dataset: ExampleDataset,
    config: ScoreOptions,
    device: torch.device,
    columns: tuple[str, ...] = ("chosen", "rejected"),
) -> list[SequenceLogps]:
    """Summed log p of the sequences `columns` names of every record under each model, with the same
    decoding orders: `logps` [R, N], `num_positions` [R]."""
    loader = DataLoader(dataset, batch_size=config.batch_size, collate_fn=collate)
    results = [[] for _ in models]
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        ranks = batch_ranks(batch, config.seed, config.num_orders, config.decoding_order)
        for model, result in zip(models, results, strict=True):
            scored = sequence_logps(model, batch, ranks, columns)
            result.append((scored.logps.cpu(), scored.num_positions.cpu()))
    return [
        SequenceLogps(torch.cat([logps for logps, _ in result]), torch.cat([count for _, count in result]))
        for result in results
    ]


def score_pairs(rows: list[dict], policy: PairLogps, reference: PairLogps | None, beta: float) -> dict:
    """Add log p (and rewards, β-scaled as TRL's and the trainer's) to each pair; accuracy and mean margin."""
    for i, row in enumerate(rows):
        row.update(preferred_logp=float(policy.chosen[i]), unpreferred_logp=float(policy.rejected[i]))
    margin, by = policy.chosen - policy.rejected, {"accuracy_by": "logp"}
    if reference is not None:
        chosen_reward = beta * (policy.chosen - reference.chosen)
        rejected_reward = beta * (policy.rejected - reference.rejected)
        for i, row in enumerate(rows):
            row.update(preferred_reward=float(chosen_reward[i]), unpreferred_reward=float(rejected_reward[i]))
        margin, by = chosen_reward - rejected_reward, {"accuracy_by": "reward", "beta": beta}
    accuracy = round_metric((margin > 0).float().mean())
    return {"accuracy": accuracy, "mean_margin": round_metric(margin.mean()), **by}


def predict_labels(
    rows: list[dict],
    locations: Sequence[str],
    dataset: ExampleDataset,
    ridge: AugmentedRidge,
    config: ScoreOptions,
) -> str:
    """Add the augmented ridge's predicted label to each variant (which has its `delta_logp`); returns the
    field it fills. A variant of a wild type the ridge was not fitted on is bad input."""
    name = f"predicted_{ridge.score_field}"
    fitted_on = ", ".join(sorted({protein.pdb_file for protein in ridge.proteins.values()}))
    errors = []
    for group in group_variants(dataset):
        wildtype = "".join(ALPHABET[t] for t in dataset.records[group.records[0]]["wildtype"])
        if wildtype not in ridge.proteins:
            errors += [
                f"{locations[i]}: its wild type ({len(wildtype)} residues) is not one {config.ridge} was "
                f"fitted on ({fitted_on}): score it without --ridge, or adapt on its protein's labels"
                for i in group.records
            ]
            continue
        variants = np.stack([np.asarray(dataset.records[i]["sequence"]) for i in group.records])
        deltas = np.array([rows[i]["delta_logp"] for i in group.records])
        for i, value in zip(group.records, ridge.predict(wildtype, variants, deltas), strict=True):
            rows[i][name] = float(value)
    if errors:
        raise_bad_records(errors)
    return name


def score_sequences(
    rows: list[dict],
    model: ProteinMPNN,
    dataset: ExampleDataset,
    config: ScoreOptions,
    device: torch.device,
    ridge: AugmentedRidge | None = None,
    locations: Sequence[str] = (),
) -> tuple[dict, list[dict]]:
    """Add `delta_logp` (records with a wild type) or `logp` and `logp_per_residue` to each record, and with
    a `ridge` the predicted label (`locations`: where each record is, for errors); Spearman's correlation of
    the last of these with `label`, pooled, and per structure (the table)."""
    per_position = config.variant_scoring in ("conditional", "joint")
    variants = [i for i, row in enumerate(rows) if row.get("wildtype_seq")]
    full = [i for i in range(len(rows)) if not (per_position and rows[i].get("wildtype_seq"))]
    if full:
        (logps,) = score_dataset([model], Subset(dataset, full), config, device, ("sequence", "wildtype"))
        sequence, wildtype = logps.logps[:, 0], logps.logps[:, 1]
        for j, i in enumerate(full):
            rows[i].update(
                logp=float(sequence[j]), logp_per_residue=float(sequence[j] / logps.num_positions[j])
            )
            if rows[i].get("wildtype_seq"):
                rows[i]["delta_logp"] = float(sequence[j] - wildtype[j])
    if config.variant_scoring == "joint" and variants:
        deltas = joint_deltas_of(model, dataset, device, config.decoding_order, config.seed, variants)
    elif per_position and variants:
        deltas = conditional_deltas(
            model, dataset, device, config.decoding_order, config.seed, config.num_orders, variants
        )
    if per_position and variants:
        for i in variants:
            rows[i]["delta_logp"] = deltas[i]
    summary: dict = {"variant_scoring": config.variant_scoring if variants else None}
    key = "delta_logp" if variants else "logp"
    if ridge is not None:
        key = predict_labels(rows, locations, dataset, ridge, config)
    field = config.score_field
    labelled = [i for i, row in enumerate(rows) if row.get(field) not in (None, "") and key in row]
    if len(labelled) < 2:
        return summary, []
    values = np.array([rows[i][key] for i in labelled], dtype=np.float64)
    labels = np.array([label_value(rows[i][field], locations, i, field) for i in labelled])
    labels = -labels if config.lower_is_better else labels
    structure_ids = column(dataset.records, "structure_id")[labelled]
    table = spearman_by_structure(values, labels, structure_ids)
    mean, median = mean_and_median(table)
    for entry in table:
        structure = dataset.structures[entry.pop("structure_id")]
        entry.update(
            pdb_file=structure["path"],
            chains=list(structure["design_chains"]),
            spearman=round_metric(entry["spearman"]),
        )
    summary.update(
        spearman_of=key,
        labelled=len(labelled),
        spearman=round_metric(spearman(values, labels)),
        structures=len(table),
        spearman_per_structure_mean=round_metric(mean),
        spearman_per_structure_median=round_metric(median),
    )
    return summary, table


def label_value(value: object, locations: Sequence[str], index: int, field: str) -> float:
    """A record's label as a number; anything else is bad input naming the record."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not np.isfinite(number):
        where = locations[index] if locations else f"record {index + 1}"
        raise DataError(f"{where}: {field} must be a finite number, got {value!r}; fix it or drop the record")
    return number


def check_ridge(ridge: AugmentedRidge, model: ProteinMPNN, path: str, variant_scoring: str | None,
                decoding_order: str | None) -> None:  # fmt: skip
    """Settings under which the augmented ridge at ``path`` would predict from another score than it was
    fitted on."""
    if variant_scoring != ridge.variant_scoring or decoding_order != ridge.decoding_order:
        raise OptionError(
            f"--ridge {path} was fitted on {ridge.variant_scoring} delta_logp with --decoding_order "
            f"{ridge.decoding_order}: give those (not --variant_scoring {variant_scoring} "
            f"--decoding_order {decoding_order})"
        )
    if model_fingerprint(model) != ridge.fingerprint:
        raise OptionError(
            f"--ridge {path} was fitted on the delta_logp of {ridge.model}, which --model "
            f"{model.name_or_path} is not: give --model {ridge.model}"
        )


def score_records(
    model: ProteinMPNN, reference: ProteinMPNN | None, data: Data, config: ScoreOptions, name: str = "records"
) -> tuple[list[dict], dict, list[dict]]:
    """Score every record of `data` (a file or records in memory): the records with their scores, the
    summary, and the per-structure Spearman table (empty without labels)."""
    records = read_records(data, name)
    given = config.given_structure(data)
    if given is not None:
        records = complete_records(records, given)
    rows = [dict(record.data or {}) for record in records]
    columns = {column for row in rows for column in normalise(row)}
    is_pairs = not ("sequence" in columns and "preferred_seq" not in columns)
    if config.score_field != "label" and not any(row.get(config.score_field) is not None for row in rows):
        raise DataError(
            f"{data_name(data, name)}: no record has the label field --score_field {config.score_field} (its "
            f"fields: {', '.join(sorted(columns))}); name the column that holds the measurements"
        )
    ridge = None if config.ridge is None else AugmentedRidge.load(config.ridge)
    config = replace(
        config,
        decoding_order=config.scoring_order(getattr(ridge, "decoding_order", None)),
        variant_scoring=config.variant_scoring or getattr(ridge, "variant_scoring", "conditional"),
    )
    if ridge is not None:
        if is_pairs:
            raise OptionError(f"--ridge {config.ridge}: it predicts labelled variants' labels, not pairs")
        check_ridge(ridge, model, config.ridge, config.variant_scoring, config.decoding_order)
        missing = [f"{r.location}: no wildtype_seq: --ridge predicts variants of a wild type it was fitted on"
                   for r, row in zip(records, rows, strict=True) if not row.get("wildtype_seq")]  # fmt: skip
        if missing:
            raise_bad_records(missing)
    options = shared_parse_options(
        model.config,
        None if reference is None else reference.config,
        config.ligand_context,
        config.ligand_exclude,
        (f"model {model.name_or_path!r}", f"reference {getattr(reference, 'name_or_path', None)!r}"),
    )
    kind = PAIRS if is_pairs else VARIANTS
    loaded = load_records(data, config.cache_dir, kind=kind, options=options, name=name, given=given)
    note = empty_context_note(context_counts(loaded.structures), options)
    if note:
        print(f"note: {note}", file=sys.stderr)
    device = resolve_device(config.device)
    summary: dict = {"count": len(rows)}
    dataset = ExampleDataset(loaded)
    table: list[dict] = []
    if is_pairs:
        models = [m.to(device).eval() for m in (model, *([reference] if reference is not None else []))]
        policy, *reference_logps = map(PairLogps.of, score_dataset(models, dataset, config, device))
        reference_logp = reference_logps[0] if reference_logps else None
        summary.update(score_pairs(rows, policy, reference_logp, config.beta))
    else:
        locations = [record.location for record in records]
        sequence_summary, table = score_sequences(
            rows, model.to(device).eval(), dataset, config, device, ridge, locations
        )
        summary.update(sequence_summary)
    return rows, summary, table


def score(
    model: ProteinMPNN | str, records: Data, *, reference: ProteinMPNN | str | None = None, **options: Any
) -> ScoredRecords | pandas.DataFrame:
    """Score preference pairs or sequences under `model` (a model, or a name or path :func:`load_model`
    takes), with the numbers `python -m dpo_inv score` writes; `options` are the command's others
    (:class:`ScoreOptions`: `variant_scoring`, `decoding_order`, `ridge`, `score_field`, `structure`,
    `chain_id`, ...), with its defaults.

    `records` is a data file, a list of dicts, a pandas DataFrame or a `datasets.Dataset`. Pairs get
    `preferred_logp` and `unpreferred_logp` (with a `reference`, also `preferred_reward` and
    `unpreferred_reward`); sequences with a `wildtype_seq` get `delta_logp`, other sequences `logp` and
    `logp_per_residue`. With `ridge`, the `augmented_ridge.json` :func:`adapt` wrote for `model`, variants
    also get `predicted_<label field>`. Records that name no structure (ProteinGym's `mutant`,
    `mutated_sequence`, `DMS_score`) take `structure` and `chain_id`, or those of the row of
    `proteingym_reference` that names the file. Returns the records with their scores: a DataFrame when
    `records` is one, else a list of dicts; the summary the command prints is their `summary` (a
    DataFrame's `attrs["summary"]`), each structure's Spearman their `per_structure`. Bad records raise
    one `DataError` (a `ValueError`), a line each.
    """
    config = ScoreOptions(**options)
    policy = as_model(model)
    rows, summary, table = score_records(policy, None if reference is None else as_model(reference), records,
                                         config)  # fmt: skip
    return with_summary(as_table(records, rows), summary, table)


class ScoredRecords(list):
    """The scored records (a list of dicts) with what the command prints: `summary` (Spearman pooled and
    per structure, or the pairs' accuracy) and `per_structure` (each structure's Spearman)."""

    summary: dict
    per_structure: list[dict]


def with_summary(
    scored: list[dict] | pandas.DataFrame, summary: dict, table: list[dict]
) -> ScoredRecords | pandas.DataFrame:
    """The scored records carrying the summary: as attributes of a list, in a DataFrame's `attrs`."""
    if isinstance(scored, list):
        scored = ScoredRecords(scored)
        scored.summary, scored.per_structure = summary, table
    else:
        scored.attrs.update(summary=summary, per_structure=table)
    return scored


def score_file(config: ScoreConfig) -> dict:
    """`python -m dpo_inv score`: score every record of `config.data`, write `config.output` (and the
    per-structure table), return the summary."""
    model = load_model(config.model)
    reference = load_model(config.reference) if config.reference else None
    rows, summary, table = score_records(model, reference, config.data, config)
    summary = {"count": summary.pop("count"), "model": config.model, "reference": config.reference, **summary}
    if config.per_structure_output and table:
        write_jsonl(config.per_structure_output, table)
    output = Path(config.output)
    write_jsonl(output, rebase_paths(rows, records_folder(config.data), output.parent))
    return summary
