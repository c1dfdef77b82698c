"""Few-shot adaptation to one protein's labelled variants: DPO on every pair of them, the number of steps and
the learning rate chosen by grouped cross-validation, the augmented ridge baseline in the same folds.

Each variant is scored as `dpo-inv score` scores it (`delta_logp`): a single mutant by the conditional
estimator (the substituted position decoded last given the rest of the wild type), a multi-mutant by the
joint estimator (its substituted positions decoded last, each given those already placed). Only the last
decoder layer and the output head are trained: the states below them are computed once per structure, so a
training step costs one pass of one layer, and cross-validation over a grid of learning rates and lengths
takes seconds to minutes on a CPU.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from peft import PeftModel

from dpo_inv.data.batches import ExampleDataset, collate, structure_inputs
from dpo_inv.data.dataset import VARIANTS, RecordSet, load_records
from dpo_inv.data.proteingym import StructureOptions
from dpo_inv.data.records import Data, DataError, write_json
from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import LoraOptions, save_adapter
from dpo_inv.models.combinations import MAX_ORDERS, Slots, base_order, joint_plan, joint_slots, slot_head
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.options import ModelOptions, ScoringOrderOptions
from dpo_inv.models.variants import (
    ConditionalStates,
    conditional_head,
    conditional_states,
    full_variants,
    group_variants,
    mean_and_median,
    order_seed,
    round_metric,
    spearman_by_structure,
    variant_labels,
)
from dpo_inv.models.weights import as_model, load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.folds import assign_folds, variant_groups
from dpo_inv.tools.ridge import (
    RIDGE_FILE,
    AugmentedRidge,
    ProteinRidge,
    augmented_features,
    fit_ridge_cv,
    model_fingerprint,
)
from dpo_inv.training.launch import (
    resolve_device,
    return_freed_memory,
    reuse_freed_memory,
    setup_environment,
    threads_kept,
    threads_per_process,
)
from dpo_inv.training.loss import PairLogps, dpo_loss

MAX_PAIRS = 200_000  # pairs per structure used by a training step; more are subsampled once, seeded


@dataclass
class AdaptFiles:
    """What `python -m dpo_inv adapt` reads: the labelled sequences and the starting model."""

    data: str | None = field(
        default=None,
        metadata={
            "help": "Labelled sequences (pdb_file, chains, sequence, wildtype_seq and a numeric label), "
            "as a file argument or --data."
        },
    )
    model: str = field(
        default="vanilla/v_48_020",
        metadata={"help": "The starting model: name, .pt file or saved directory."},
    )


@dataclass(kw_only=True)
class AdaptOptions(StructureOptions, ModelOptions, LoraOptions, ScoringOrderOptions):
    """How a model is adapted: the options of `adapt` in Python, and the command's besides its files."""

    output_dir: str = field(default="outputs/adapt", metadata={"help": "Writes final/ and adapt.json."})
    score_field: str = field(default="label", metadata={"help": "The record field holding the label."})
    lower_is_better: bool = field(default=False, metadata={"help": "Lower labels are better (e.g. ΔΔG)."})
    num_folds: int = field(default=5, metadata={"help": "Cross-validation folds (grouped by position)."})
    learning_rates: list[float] = field(
        default_factory=lambda: [3e-4], metadata={"help": "Learning rates cross-validation tries."}
    )
    max_steps: list[int] = field(
        default_factory=lambda: [10, 20, 30, 50, 75, 100],
        metadata={"help": "Training lengths (optimizer steps) cross-validation tries."},
    )
    beta: float = field(default=0.1, metadata={"help": "DPO's β."})
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = field(
        default="sigmoid", metadata={"help": "sigmoid, ipo, hinge or robust (TRL's names)."}
    )
    min_labels: int = field(
        default=20, metadata={"help": "Fewer labelled sequences than this: keep the starting model."}
    )
    seed: int = field(default=42, metadata={"help": "Seed of the folds, the decoding orders, the pairs."})

    def __post_init__(self) -> None:
        self.decoding_order = self.scoring_order(fallback="left_to_right")


@dataclass
class AdaptConfig(AdaptOptions, AdaptFiles):
    """`python -m dpo_inv adapt`: its files, then its options."""


@dataclass
class VariantSet:
    """The labelled variants of one structure and wild type, and what scoring them needs."""

    structure_id: int
    records: np.ndarray  # indices into the data file, in file order
    labels: np.ndarray
    variants: np.ndarray  # [records, L] tokens of each sequence
    wildtype: np.ndarray  # [L] tokens of the wild type
    # what the last decoder layer reads: one state per substituted position (the conditional estimator:
    # every variant a single mutant), or one per slot of the joint estimator (some variant has several)
    states: ConditionalStates | Slots
    changes: (
        torch.Tensor
    )  # sparse [records, rows * vocab]: +w at (row, variant token), -w at (row, wild type)
    reference: torch.Tensor  # delta_logp of each record under the starting model

    def deltas(self, model: ProteinMPNN) -> torch.Tensor:
        """`delta_logp` of every record under `model` (differentiable in its last layer and head)."""
        if isinstance(self.states, Slots):
            table = slot_head(model, self.states)
        else:
            table = conditional_head(model, self.states)
        return torch.sparse.mm(self.changes, table.reshape(-1, 1)).squeeze(1)

    def subset(self, rows: np.ndarray) -> VariantSet:
        """The set of records ``rows`` (indices into this set's records) on the same states."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.reference.device)
        return VariantSet(
            self.structure_id,
            self.records[rows],
            self.labels[rows],
            self.variants[rows],
            self.wildtype,
            self.states,
            self.changes.index_select(0, index).coalesce(),
            self.reference[index],
        )


def variant_set(
    model: ProteinMPNN,
    batch: dict[str, torch.Tensor],
    variants: np.ndarray,
    labels: np.ndarray,
    seed: int | None,
    structure_id: int = 0,
    records: np.ndarray | None = None,
    max_orders: int = MAX_ORDERS,
) -> VariantSet:
    """The `VariantSet` of ``variants [R, L]`` (tokens) on the one structure of ``batch`` (its `wildtype`
    sequence the wild type), the other residues decoded left to right (``seed=None``) or in an order drawn
    from ``seed``: the conditional estimator's states when every variant is a single mutant, else the joint
    estimator's slots (`dpo_inv.models.combinations`, at most ``max_orders`` orders of a variant's mutated
    positions; equal on single mutants)."""
    device = batch["mask"].device
    wildtype = batch["wildtype"][0].cpu().numpy()
    changed = variants != wildtype[None, :]
    vocab = model.config.vocab_size
    if changed.sum(1).max(initial=0) > 1:
        plan = joint_plan(wildtype, variants, base_order(len(wildtype), seed), vocab, max_orders)
        with torch.no_grad():
            enc = model.encode(**structure_inputs(batch))
        states: ConditionalStates | Slots = joint_slots(model, enc, batch["wildtype"][0], plan)
        changes = plan.changes.to(device)
    else:
        positions = sorted(set(np.flatnonzero(changed.any(0)).tolist())) or [0]
        states = conditional_states(model, batch, positions, seed)
        row = {p: i for i, p in enumerate(positions)}
        index, value = [], []
        for r, variant in enumerate(variants):
            for p in np.flatnonzero(variant != wildtype):
                index += [(r, row[p] * vocab + variant[p]), (r, row[p] * vocab + wildtype[p])]
                value += [1.0, -1.0]
        changes = torch.sparse_coo_tensor(
            torch.tensor(index, dtype=torch.long).reshape(-1, 2).T,
            torch.tensor(value),
            (len(variants), len(positions) * vocab),
            device=device,
            check_invariants=False,
        ).coalesce()
    records = np.arange(len(variants)) if records is None else records
    result = VariantSet(structure_id, records, labels, variants, wildtype, states, changes, torch.empty(0))
    with torch.no_grad():
        result.reference = result.deltas(model)
    return result


def variant_sets(
    model: ProteinMPNN, data: RecordSet, labels: np.ndarray, config: AdaptOptions, device: torch.device
) -> list[VariantSet]:
    """One `VariantSet` per (structure, wild type) of the data, with its decoder states computed once."""
    dataset = ExampleDataset(data)
    sets = []
    for group in group_variants(dataset):
        batch = {k: v.to(device) for k, v in collate([dataset[group.records[0]]]).items()}
        seed = order_seed(group, config.decoding_order, config.seed)
        variants = full_variants(dataset, group.records, batch["wildtype"][0].cpu().numpy())
        records = np.array(group.records)
        sets.append(variant_set(model, batch, variants, labels[records], seed, group.structure_id, records))
    return sets


def training_pairs(labels: np.ndarray, train: np.ndarray, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(preferred, dispreferred) record indices: every ordered pair of training records whose labels differ,
    subsampled to `MAX_PAIRS`."""
    chosen, rejected = np.nonzero((labels[:, None] > labels[None, :]) & train[:, None] & train[None, :])
    if len(chosen) > MAX_PAIRS:
        keep = np.random.default_rng(seed).choice(len(chosen), MAX_PAIRS, replace=False)
        chosen, rejected = chosen[keep], rejected[keep]
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


def head_parameters(model: ProteinMPNN) -> list[torch.nn.Parameter]:
    """What adaptation trains: the last decoder layer and the output head."""
    return [*model.decoder_layers[-1].parameters(), *model.W_out.parameters()]


def head_adapter(model: ProteinMPNN, config: AdaptOptions) -> PeftModel:
    """`model` with a LoRA adapter on the maps of the last decoder layer and the output head (or the
    lora_target_modules given, which must lie there: the layers below are computed once, before training)."""
    last = f"decoder_layers.{len(model.decoder_layers) - 1}."
    adapted = config.adapter(model, rf"{re.escape(last)}(W1|W2|W3|dense\.W_in|dense\.W_out)|W_out")
    names = adapted.targeted_module_names
    outside = [name for name in names if not name.startswith(last) and name != "W_out"]
    if outside:
        raise OptionError(
            f"lora_target_modules: adapt trains the last decoder layer and the output head, but "
            f"{', '.join(outside)} lie below them; name maps of {last[:-1]} or W_out"
        )
    return adapted


def train_head(
    start: ProteinMPNN,
    sets: Sequence[VariantSet],
    train: Sequence[np.ndarray],
    learning_rate: float,
    checkpoints: Sequence[int],
    config: AdaptOptions,
) -> tuple[ProteinMPNN, dict[int, list[np.ndarray]]]:
    """Train a copy of `start` with DPO on the pairs of each set's training records (``train[k]``, a mask
    over set k's records) for ``max(checkpoints)`` steps, full batch, AdamW; returns the model and every
    record's `delta_logp` at each checkpoint. Dropout stays off: the model is in eval mode throughout."""
    model = copy.deepcopy(start).eval().requires_grad_(False)
    if config.use_peft:
        model = head_adapter(model, config).eval()
        parameters = [p for p in model.parameters() if p.requires_grad]
    else:
        parameters = head_parameters(model)
        for parameter in parameters:
            parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    pairs = [training_pairs(s.labels, mask, config.seed) for s, mask in zip(sets, train, strict=True)]
    used = [(s, p) for s, p in zip(sets, pairs, strict=True) if len(p[0])]
    deltas: dict[int, list[np.ndarray]] = {}
    for step in range(1, max(checkpoints) + 1):
        loss = 0.0
        for variant_set, (chosen, rejected) in used:
            delta = variant_set.deltas(model)
            ones = torch.ones(len(chosen), device=delta.device)
            policy = PairLogps(delta[chosen], delta[rejected], ones)
            reference = PairLogps(variant_set.reference[chosen], variant_set.reference[rejected], ones)
            loss = loss + dpo_loss(policy, reference, config.beta, config.loss_type).losses.mean()
        if used:  # a fold whose training records have no pair of different labels trains nothing
            optimizer.zero_grad()
            (loss / len(used)).backward()
            optimizer.step()
        if step in checkpoints:
            with torch.no_grad():
                deltas[step] = [s.deltas(model).cpu().numpy() for s in sets]
    return model.requires_grad_(True), deltas


def mean_spearman(values: Sequence[np.ndarray], sets: Sequence[VariantSet]) -> tuple[float, list[dict]]:
    """Mean over structures of Spearman's correlation of `values` (one array per set) with the labels."""
    table = spearman_by_structure(
        np.concatenate(values),
        np.concatenate([s.labels for s in sets]),
        np.concatenate([np.full(len(s.records), s.structure_id) for s in sets]),
    )
    return mean_and_median(table)[0], table


def ridge_out_of_fold(sets: Sequence[VariantSet], folds: Sequence[np.ndarray], seed: int) -> list[np.ndarray]:
    """Out-of-fold predictions of the augmented ridge model (one-hot + the starting model's `delta_logp`),
    fitted per set on the other folds."""
    predictions = []
    for variant_set, fold in zip(sets, folds, strict=True):
        features = augmented_features(variant_set.variants, variant_set.reference.cpu().numpy())
        predicted = variant_set.reference.cpu().numpy().astype(np.float64).copy()
        for k in np.unique(fold):
            held_out = fold == k
            if (~held_out).sum() >= 3 and np.ptp(variant_set.labels[~held_out]) > 0:
                ridge = fit_ridge_cv(features[~held_out], variant_set.labels[~held_out], 1, seed)
                predicted[held_out] = ridge.predict(features[held_out])
        predictions.append(predicted)
    return predictions


def fit_augmented_ridge(model: ProteinMPNN, sets: Sequence[VariantSet], scores: Sequence[np.ndarray],
                        data: RecordSet, config: AdaptOptions) -> AugmentedRidge:  # fmt: skip
    """Augmented ridge for `model`'s `delta_logp`, fitted on every label: one model per wild type (the sets
    of one wild type on several structures pooled). Each labelled variant's score is `scores` (per set):
    cross-fitted, by a model that did not train on its label, so that the ridge weighs the adapted score by
    how well it predicts variants it has not seen, as it will be used, not by how well it was fitted."""
    by_wildtype: dict[str, list[int]] = {}
    for i, variant_set in enumerate(sets):
        by_wildtype.setdefault("".join(ALPHABET[t] for t in variant_set.wildtype), []).append(i)
    proteins = {}
    for wildtype, members in by_wildtype.items():
        features = np.vstack([augmented_features(sets[i].variants, scores[i]) for i in members])
        labels = np.concatenate([sets[i].labels for i in members])
        proteins[wildtype] = ProteinRidge(
            data.structures[sets[members[0]].structure_id]["path"],
            len(labels),
            fit_ridge_cv(features, labels, 1, config.seed),
        )
    scoring = "joint" if any(isinstance(s.states, Slots) for s in sets) else "conditional"
    return AugmentedRidge(str((Path(config.output_dir) / "final").resolve()), model_fingerprint(model),
                          config.decoding_order, config.score_field, config.lower_is_better, proteins,
                          scoring)  # fmt: skip


def check_labels(sets: Sequence[VariantSet], data: RecordSet, config: AdaptOptions) -> None:
    """Bad input: fewer labelled sequences than folds, or a structure whose labels are all equal."""
    count = sum(len(s.records) for s in sets)
    if count < config.num_folds:
        raise DataError(
            f"{data.source}: {count} labelled sequences for {config.num_folds} folds; label at least "
            f"{config.num_folds} sequences or lower --num_folds"
        )
    for variant_set in sets:
        if np.ptp(variant_set.labels) == 0:
            path = data.structures[variant_set.structure_id]["path"]
            raise DataError(
                f"{data.source}: every label of the {len(variant_set.records)} sequences on {path} is "
                f"{variant_set.labels[0]:g}: a constant label ranks nothing; check --score_field"
            )


@dataclass
class Choice:
    learning_rate: float
    max_steps: int
    spearman: float


def cross_validate(
    model: ProteinMPNN, sets: list[VariantSet], folds: list[np.ndarray], config: AdaptOptions
) -> tuple[list[Choice], dict[float, dict[int, list[np.ndarray]]]]:
    """Every (learning rate, length) of the grid, scored by the mean per-structure Spearman of its
    out-of-fold `delta_logp`; the (fold, learning rate) jobs are shared out over the processes."""
    state = PartialState()
    jobs = [(k, lr) for k in range(config.num_folds) for lr in config.learning_rates]
    mine = {}
    for k, lr in jobs[state.process_index :: state.num_processes]:
        train = [fold != k for fold in folds]
        _, deltas = train_head(model, sets, train, lr, config.max_steps, config)
        mine[(k, lr)] = {
            step: [d[fold == k] for d, fold in zip(values, folds, strict=True)]
            for step, values in deltas.items()
        }
    results = {key: value for part in gather_object([mine]) for key, value in part.items()}
    out_of_fold: dict[float, dict[int, list[np.ndarray]]] = {}
    grid = []
    for lr in config.learning_rates:
        out_of_fold[lr] = {}
        for steps in config.max_steps:
            values = [np.zeros(len(s.records)) for s in sets]
            for k in range(config.num_folds):
                for values_k, part, fold in zip(values, results[(k, lr)][steps], folds, strict=True):
                    values_k[fold == k] = part
            out_of_fold[lr][steps] = values
            grid.append(Choice(lr, steps, mean_spearman(values, sets)[0]))
    return grid, out_of_fold


def fold_sets(sets: Sequence[VariantSet], num_folds: int, seed: int) -> list[np.ndarray]:
    """The fold of every record of each set (`dpo_inv.tools.folds`: grouped by position or near-duplicate)."""
    groups = variant_groups(
        [variant for s in sets for variant in s.variants],
        [s.wildtype for s in sets for _ in s.records],
        [s.structure_id for s in sets for _ in s.records],
    )
    fold_of = assign_folds(groups, num_folds, seed)
    bounds = np.cumsum([0] + [len(s.records) for s in sets])
    return [fold_of[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass
class Adapted:
    """The outcome of adaptation: the model to ship and what cross-validation measured."""

    model: ProteinMPNN
    decision: str
    best: Choice
    grid: list[Choice]
    start: list[dict]  # per structure: count, Spearman of the starting model
    adapted: list[dict]  # ... of the chosen configuration, out of fold
    ridge: list[dict]  # ... of the augmented ridge baseline, out of fold
    start_mean: float
    ridge_mean: float
    out_of_fold: list[np.ndarray]  # per set, each record's delta_logp by a model that did not train on it


def choose_and_train(model: ProteinMPNN, sets: list[VariantSet], config: AdaptOptions) -> Adapted:
    """Cross-validate the grid, then train on every label with the best configuration; the starting model
    is kept with too few labels or no cross-validated gain."""
    folds = fold_sets(sets, config.num_folds, config.seed)
    grid, out_of_fold = cross_validate(model, sets, folds, config)
    best = max(grid, key=lambda c: (c.spearman, -c.max_steps))
    start_mean, start = mean_spearman([s.reference.cpu().numpy() for s in sets], sets)
    ridge_mean, ridge = mean_spearman(ridge_out_of_fold(sets, folds, config.seed), sets)
    _, adapted = mean_spearman(out_of_fold[best.learning_rate][best.max_steps], sets)
    count = sum(len(s.records) for s in sets)
    held_out = out_of_fold[best.learning_rate][best.max_steps]
    if count < config.min_labels:
        decision = f"kept the starting model: {count} labelled sequences, fewer than --min_labels "
        decision += str(config.min_labels)
    elif not best.spearman > start_mean:
        decision = (
            "kept the starting model: adaptation did not rank held-out sequences better in "
            f"cross-validation ({best.spearman:.3f} against {start_mean:.3f})"
        )
    else:
        decision = "adapted"
        everything = [np.ones(len(s.records), dtype=bool) for s in sets]
        model, _ = train_head(model, sets, everything, best.learning_rate, [best.max_steps], config)
    if decision != "adapted":
        held_out = [s.reference.cpu().numpy() for s in sets]
    return Adapted(model, decision, best, grid, start, adapted, ridge, start_mean, ridge_mean, held_out)


def check_options(config: AdaptOptions) -> None:
    """Options that would train the wrong thing: a `ValueError` names the option and the fix."""
    config.check_lora()
    if config.num_folds < 2:
        raise OptionError(f"--num_folds {config.num_folds}: cross-validation needs at least 2 folds")
    if not config.learning_rates or min(config.learning_rates) <= 0:
        raise OptionError(f"--learning_rates {config.learning_rates}: give one or more positive rates")
    if not config.max_steps or min(config.max_steps) < 1:
        raise OptionError(f"--max_steps {config.max_steps}: give one or more positive numbers of steps")
    if config.beta <= 0:
        raise OptionError(f"--beta {config.beta}: β must be positive")


def adapt_model(model: ProteinMPNN, data: Data, config: AdaptOptions) -> tuple[ProteinMPNN, dict[str, Any]]:
    """Adapt `model` to the labelled sequences of `data` (a file or records in memory): save the model to
    ship as ``output_dir/final`` and write ``output_dir/adapt.json``; returns that model and that report."""
    start_time = time.time()
    check_options(config)
    reuse_freed_memory()
    with threads_kept(threads_per_process(setup_environment().local_world_size)):
        state = PartialState()
    device = resolve_device(config.device) if config.device or state.num_processes == 1 else state.device
    given = config.given_structure(data)
    labels = np.array(variant_labels(data, config.score_field, config.lower_is_better, "records", given))
    options = config.parse_options(model.config)
    with state.main_process_first():
        loaded = load_records(data, config.cache_dir, kind=VARIANTS, options=options, given=given)
    model = copy.deepcopy(model).to(device)
    sets = variant_sets(model, loaded, labels, config, device)
    check_labels(sets, loaded, config)
    result = choose_and_train(model, sets, config)
    final = Path(config.output_dir) / "final"
    ridge_file = Path(config.output_dir) / RIDGE_FILE
    if state.is_main_process:
        if isinstance(result.model, PeftModel):  # the ridge holds for the model the folder loads as
            save_adapter(result.model, final)
            scored_by = load_model(final)
        else:
            result.model.save_pretrained(final)
            scored_by = result.model
        fit_augmented_ridge(scored_by, sets, result.out_of_fold, loaded, config).save(ridge_file)
    structures = []
    for start, adapted, ridge in zip(result.start, result.adapted, result.ridge, strict=True):
        structure = loaded.structures[start["structure_id"]]
        structures.append(
            {
                "pdb_file": structure["path"],
                "chains": list(structure["design_chains"]),
                "labelled": start["count"],
                "spearman_start": round_metric(start["spearman"]),
                "spearman_adapted": round_metric(adapted["spearman"]),
                "spearman_augmented_ridge": round_metric(ridge["spearman"]),
            }
        )
    report = {
        "data": loaded.source,
        "model": model.config.name_or_path,
        "labelled": sum(len(s.records) for s in sets),
        "decision": result.decision,
        "final_model": str(final),
        "learning_rate": result.best.learning_rate,
        "max_steps": result.best.max_steps,
        "cv_folds": config.num_folds,
        "cv_spearman_start": round_metric(result.start_mean),
        "cv_spearman_adapted": round_metric(result.best.spearman),
        "cv_spearman_augmented_ridge": round_metric(result.ridge_mean),
        "final_ridge": str(ridge_file),
        "structures": structures,
        "grid": [{**asdict(c), "spearman": round_metric(c.spearman)} for c in result.grid],
        "seconds": round(time.time() - start_time, 1),
        "config": {**asdict(config), "data": loaded.source, "model": model.config.name_or_path},
    }
    if state.is_main_process:
        write_json(Path(config.output_dir) / "adapt.json", report)
    state.wait_for_everyone()
    return_freed_memory()
    return result.model.eval(), report


class AdaptOutput(NamedTuple):
    """What `adapt` returns: the model to use (adapted, or the starting model when adaptation did not help)
    and the report of adapt.json."""

    model: ProteinMPNN
    report: dict[str, Any]


def adapt(records: Data, model: ProteinMPNN | str = "vanilla/v_48_020", **options: Any) -> AdaptOutput:
    """Adapt `model` (a model, or a name or path :func:`load_model` takes) to one protein's labelled
    variants, as `python -m dpo_inv adapt` does; `model` itself is not changed. `options` are the
    command's others (:class:`AdaptOptions`: `output_dir`, `score_field`, `max_steps`, `structure`, ...),
    with its defaults.

    `records` is a data file, a list of dicts, a pandas DataFrame or a `datasets.Dataset` of variants with
    `pdb_file`, chains, `sequence`, `wildtype_seq` and a number in `score_field` (higher = better unless
    `lower_is_better`). The number of DPO steps and the learning rate are chosen by grouped
    cross-validation over `learning_rates` x `max_steps`; the starting model is kept with fewer than
    `min_labels` labels or without a cross-validated gain. Records that name no structure (ProteinGym's
    layout) take `structure` and `chain_id` (or `proteingym_reference`'s row), as `score` does. Writes
    `output_dir/final` and `output_dir/adapt.json`; returns the model and that report (cross-validated
    Spearman of the starting model, the adapted model and augmented ridge, per structure).
    """
    config = AdaptOptions(**options)
    return AdaptOutput(*adapt_model(as_model(model), records, config))


def adapt_file(config: AdaptConfig) -> dict[str, Any]:
    """`python -m dpo_inv adapt`: adapt ``config.model`` to the labelled sequences of ``config.data``;
    returns the report."""
    return adapt_model(load_model(config.model), config.data, config)[1]


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What `python -m dpo_inv adapt` prints: one line per structure, then the outcome."""
    lines = [
        f"{s['pdb_file']} ({','.join(s['chains'])}): {s['labelled']} labelled; cross-validated Spearman: "
        f"start {s['spearman_start']}, adapted {s['spearman_adapted']}, augmented ridge "
        f"{s['spearman_augmented_ridge']}"
        for s in report["structures"]
    ]
    outcome = (
        f"adapted model ({report['max_steps']} steps at learning rate {report['learning_rate']:g}) saved to "
        f"{report['final_model']}"
        if report["decision"] == "adapted"
        else f"{report['decision']}; saved to {report['final_model']}"
    )
    lines.append(
        f"Done: cross-validated Spearman {report['cv_spearman_adapted']} "
        f"(start {report['cv_spearman_start']}, augmented ridge {report['cv_spearman_augmented_ridge']}, "
        f"{report['cv_folds']} folds grouped by position); {outcome}, augmented ridge on its score to "
        f"{report['final_ridge']} (dpo-inv score --ridge)"
    )
    return lines
