"""Variant effects from one encoder pass per structure: ProteinMPNN's conditional log-probabilities.

A variant differs from its wild type at a few positions. Each substituted position is decoded last, given
every other residue of the wild type (the estimator of ProteinMPNN-ddG), so one encoder pass and one batch of
decoder passes per structure score every substitution at every position at once:

    delta_logp = sum over substituted positions p of  log p(variant_p | rest) - log p(wildtype_p | rest)

For a single mutant this equals the full-sequence difference log p(variant) - log p(wild type) under the
same decoding order with p moved to the end (positions decoded before p never see it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from dpo_inv.data.batches import ExampleDataset, collate, structure_inputs
from dpo_inv.data.dataset import RecordSet, column
from dpo_inv.data.proteingym import GivenStructure, complete_records
from dpo_inv.data.records import Data, raise_bad_records, read_records
from dpo_inv.errors import StructureError
from dpo_inv.models.combinations import (
    WildtypePass,
    base_order,
    joint_deltas,
    joint_plan,
    reordered_passes,
    wildtype_pass,
)
from dpo_inv.models.layers import DecoderStates, Encoding
from dpo_inv.models.mpnn import ProteinMPNN, decoding_ranks, derive_seed

ORDERS_PER_PASS = 64  # decoding orders (substituted positions x orders) per decoder batch
STATES_PER_PASS = 16  # positions per decoder batch of `conditional_states` (its states are kept)


@dataclass(frozen=True)
class LabelledVariants:
    """Variants (`sequence`, and its `wildtype`) and their labels, higher = better."""

    data: RecordSet
    labels: list[float]


@dataclass(frozen=True)
class VariantGroup:
    """Records that share a structure and a wild type, and the positions where any of them differs."""

    structure_id: int
    records: list[int]  # indices into the dataset, in file order
    positions: list[int]  # sorted 0-based indices into the designed sequence


def group_variants(dataset: ExampleDataset, records: Sequence[int] | None = None) -> list[VariantGroup]:
    """Group records (default: all) of a variants dataset by structure and wild type."""
    members: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    positions: dict[tuple[int, bytes], set[int]] = defaultdict(set)
    rows = dataset.records if records is None else dataset.records.select(records)
    indices = range(len(dataset)) if records is None else records
    for index, sid, variant, wildtype in zip(
        indices, rows["structure_id"], rows["sequence"], rows["wildtype"], strict=True
    ):
        variant, wildtype = np.asarray(variant), np.asarray(wildtype)
        key = (int(sid), wildtype.tobytes())
        members[key].append(index)
        positions[key].update(np.flatnonzero(variant != wildtype).tolist())
    return [VariantGroup(key[0], members[key], sorted(positions[key])) for key in members]


def conditional_inputs(
    batch: dict[str, torch.Tensor], positions: list[int], seed: int | None, num_orders: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder inputs that score each of ``positions`` last: the wild type (`wildtype`) once per position
    and order, ``[1, N * num_orders, L]``, their decoding ranks, and the position each pass scores,
    ``[1, 1, N * num_orders]``."""
    L = batch["mask"].shape[1]
    chunk = torch.tensor(positions, device=batch["mask"].device)
    N = len(chunk)
    last = torch.zeros(N, L, device=chunk.device)
    last[torch.arange(N), chunk] = 1
    ranks = decoding_ranks(
        last, batch["mask"].expand(N, L), None if seed is None else [seed] * N, num_orders, [L] * N
    ).view(1, N * num_orders, L)
    S = batch["wildtype"].unsqueeze(1).expand(1, N * num_orders, L)
    return S, ranks, chunk.repeat_interleave(num_orders).view(1, 1, -1)


def conditional_wildtype(
    model: ProteinMPNN, enc: Encoding, batch: dict[str, torch.Tensor], seed: int | None, num_orders: int
) -> WildtypePass:
    """The wild type decoded in the orders :func:`conditional_inputs` draws, no position moved to the end."""
    L = batch["mask"].shape[1]
    ranks = decoding_ranks(torch.zeros_like(batch["mask"]), batch["mask"], None if seed is None else [seed],
                           num_orders, [L])  # fmt: skip
    return wildtype_pass(model, enc, batch["wildtype"][0], ranks[0])


def decoded_last(
    model: ProteinMPNN,
    enc: Encoding,
    batch: dict[str, torch.Tensor],
    wildtype: WildtypePass,
    positions: list[int],
    seed: int | None,
    num_orders: int,
) -> tuple[DecoderStates, torch.Tensor]:
    """The decoder states below the last layer of the passes that score each of ``positions`` last (see
    :func:`conditional_inputs`), each a reordering of ``wildtype`` (:func:`reordered_passes`), and the
    position each pass scores ``[1, 1, N * num_orders]``."""
    _, ranks, where = conditional_inputs(batch, positions, seed, num_orders)
    order = torch.arange(ranks.shape[1], device=ranks.device) % num_orders
    states, mask_bw = reordered_passes(model, enc, wildtype, ranks[0], order)
    return DecoderStates(h_V=states[-1], h_S=wildtype.h_S.expand_as(states[-1]), mask_bw=mask_bw), where


@torch.no_grad()
def conditional_log_probs(
    model: ProteinMPNN,
    batch: dict[str, torch.Tensor],
    positions: list[int],
    seed: int | None,
    num_orders: int = 1,
) -> torch.Tensor:
    """Log-probabilities ``[P, 21]`` at each of ``positions`` of the one structure in ``batch`` (its
    `rejected` sequence is the wild type), each decoded last given all other residues.

    The other residues are decoded left to right (``seed=None``) or in ``num_orders`` random orders drawn
    from ``seed``, as the trainer draws them for a record; log-probabilities are averaged over the orders.
    """
    enc = model.encode(**structure_inputs(batch))
    wildtype = conditional_wildtype(model, enc, batch, seed, num_orders)
    results = []
    per_pass = max(1, ORDERS_PER_PASS // num_orders)
    for start in range(0, len(positions), per_pass):
        chunk = positions[start : start + per_pass]
        states, where = decoded_last(model, enc, batch, wildtype, chunk, seed, num_orders)
        log_probs = model.decode_last(enc, states, where)  # [1, 1, N*K, 21]
        results.append(log_probs.float().view(len(chunk), num_orders, -1).mean(1))
    return torch.cat(results)


@dataclass
class ConditionalStates:
    """What the last decoder layer needs to score each of a structure's positions last: computed once
    with :func:`conditional_states`, then :func:`conditional_head` is one pass of that layer."""

    encoding: Encoding
    states: DecoderStates
    positions: torch.Tensor  # [1, 1, N]


@torch.no_grad()
def conditional_states(
    model: ProteinMPNN, batch: dict[str, torch.Tensor], positions: list[int], seed: int | None
) -> ConditionalStates:
    """The encoder output and the decoder states below the last layer for scoring each of ``positions``
    last (one decoding order: left to right with ``seed=None``, else drawn from ``seed``), computed
    `STATES_PER_PASS` positions at a time."""
    enc = model.encode(**structure_inputs(batch))
    wildtype = conditional_wildtype(model, enc, batch, seed, 1)
    parts = [
        decoded_last(model, enc, batch, wildtype, positions[start : start + STATES_PER_PASS], seed, 1)[0]
        for start in range(0, len(positions), STATES_PER_PASS)
    ]
    states = DecoderStates(
        h_V=torch.cat([part.h_V for part in parts], 2),
        h_S=torch.cat([part.h_S for part in parts], 2),
        mask_bw=torch.cat([part.mask_bw for part in parts], 3),
    )
    where = torch.tensor(positions, device=batch["mask"].device).view(1, 1, -1)
    return ConditionalStates(enc, states, where)


def conditional_head(model: ProteinMPNN, states: ConditionalStates) -> torch.Tensor:
    """Log-probabilities ``[P, 21]`` at the positions of ``states`` from the model's last decoder layer and
    output head (the gradient reaches those two only)."""
    log_probs = model.decode_last(states.encoding, states.states, states.positions)
    return log_probs.float().view(states.positions.shape[-1], -1)


def group_batch(
    dataset: ExampleDataset, group: VariantGroup, device: torch.device
) -> dict[str, torch.Tensor]:
    """The collated structure of a group of variants; a substitution at an unobserved residue is bad input."""
    batch = {k: v.to(device) for k, v in collate([dataset[group.records[0]]]).items()}
    unobserved = [p for p in group.positions if batch["mask"][0, p] == 0]
    if unobserved:
        raise StructureError(  # not a DataError: on the ranks that meet it, not all together
            f"substitution at position {unobserved[0]} of a residue without backbone coordinates "
            f"(structure {dataset.structures[group.structure_id]['path']}); it cannot be scored"
        )
    return batch


def order_seed(group: VariantGroup, decoding_order: str, seed: int) -> int | None:
    """The seed of a group's decoding order: None (left to right), or one drawn from ``seed`` and its first
    record, as the trainer draws a record's order."""
    return None if decoding_order == "left_to_right" else derive_seed(seed, 0, group.records[0])


@torch.no_grad()
def conditional_deltas(
    model: ProteinMPNN,
    dataset: ExampleDataset,
    device: torch.device,
    decoding_order: str = "left_to_right",
    seed: int = 0,
    num_orders: int = 1,
    records: Sequence[int] | None = None,
) -> dict[int, float]:
    """`delta_logp` (variant minus wild type, summed over substituted positions) of each record (default:
    all), by dataset index."""
    deltas: dict[int, float] = {}
    for group in group_variants(dataset, records):
        if not group.positions:
            deltas.update((index, 0.0) for index in group.records)
            continue
        batch = group_batch(dataset, group, device)
        table = conditional_log_probs(model, batch, group.positions, order_seed(group, decoding_order, seed),
                                      num_orders).cpu()  # fmt: skip
        row = {p: i for i, p in enumerate(group.positions)}
        wildtype = batch["wildtype"][0].cpu()
        for index in group.records:
            variant = torch.from_numpy(np.asarray(dataset.records[index]["sequence"], dtype=np.int64))
            changed = torch.nonzero(variant != wildtype[: len(variant)]).flatten().tolist()
            deltas[index] = float(
                sum(table[row[p], variant[p]] - table[row[p], wildtype[p]] for p in changed)
            )
    return deltas


def full_variants(dataset: ExampleDataset, records: Sequence[int], wildtype: np.ndarray) -> np.ndarray:
    """``[R, L]`` tokens of the records' variants: their designed chains, the wild type's other chains."""
    designed = np.stack([np.asarray(dataset.records[i]["sequence"]) for i in records])
    rest = wildtype[designed.shape[1] :]
    return np.hstack([designed, np.broadcast_to(rest, (len(designed), len(rest)))])


@torch.no_grad()
def joint_deltas_of(
    model: ProteinMPNN,
    dataset: ExampleDataset,
    device: torch.device,
    decoding_order: str = "left_to_right",
    seed: int = 0,
    records: Sequence[int] | None = None,
) -> dict[int, float]:
    """`delta_logp` of each record (default: all) by the joint estimator of `dpo_inv.models.combinations`
    (the substituted positions decoded last, each given those already placed; on a single mutant the
    conditional estimator), by dataset index."""
    deltas: dict[int, float] = {}
    for group in group_variants(dataset, records):
        if not group.positions:
            deltas.update((index, 0.0) for index in group.records)
            continue
        batch = group_batch(dataset, group, device)
        wildtype = batch["wildtype"][0]
        variants = full_variants(dataset, group.records, wildtype.cpu().numpy())
        order = base_order(len(wildtype), order_seed(group, decoding_order, seed))
        plan = joint_plan(wildtype.cpu().numpy(), variants, order, model.config.vocab_size)
        values = joint_deltas(model, model.encode(**structure_inputs(batch)), wildtype, plan)
        deltas.update(zip(group.records, values.tolist(), strict=True))
    return deltas


def round_metric(value: float, digits: int = 4) -> float | None:
    """A metric as printed and written: rounded, and None when it is not a number."""
    return round(float(value), digits) if np.isfinite(value) else None


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties get their average rank); NaN when either side is constant."""

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        ranked = np.empty(len(x))
        ranked[order] = np.arange(len(x))
        _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
        return (np.bincount(inverse, ranked) / counts)[inverse]

    ra, rb = ranks(a), ranks(b)
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def spearman_by_structure(values: np.ndarray, labels: np.ndarray, structure_ids: np.ndarray) -> list[dict]:
    """One entry per structure, in order of first appearance: `structure_id`, `count` and `spearman`
    (NaN with fewer than 3 records or constant values)."""
    table = []
    for sid in dict.fromkeys(structure_ids.tolist()):
        chosen = structure_ids == sid
        rho = spearman(values[chosen], labels[chosen]) if chosen.sum() >= 3 else float("nan")
        table.append({"structure_id": sid, "count": int(chosen.sum()), "spearman": rho})
    return table


def mean_and_median(table: list[dict]) -> tuple[float, float]:
    """Mean and median of the per-structure Spearman correlations that are defined (NaN when none is)."""
    defined = [entry["spearman"] for entry in table if np.isfinite(entry["spearman"])]
    return (float(np.mean(defined)), float(np.median(defined))) if defined else (math.nan, math.nan)


def variant_labels(
    data: Data,
    field: str = "label",
    lower_is_better: bool = False,
    name: str = "records",
    given: GivenStructure | None = None,
) -> list[float]:
    """The label (``field``) of every record of labelled variants (a file, or records in memory named
    ``name``; those that name no structure take ``given``'s), which must also give a `wildtype_seq`,
    oriented so that higher is better; a `DataError` names each record without them."""
    labels, errors = [], []
    direction = "lower" if lower_is_better else "higher"
    records = read_records(data, name)
    for record in records if given is None else complete_records(records, given):
        if record.data is None:
            errors.append(f"{record.location}: {record.error}")
            continue
        row = record.data
        label = row.get(field)
        if isinstance(label, bool) or not isinstance(label, (int, float)) or not math.isfinite(label):
            errors.append(
                f"{record.location}: {field} must be a finite number ({direction} = better), got {label!r}"
            )
        elif not row.get("wildtype_seq"):
            errors.append(f"{record.location}: missing wildtype_seq: a labelled variant needs its wild type")
        else:
            labels.append(-float(label) if lower_is_better else float(label))
    if errors:
        raise_bad_records(errors)
    return labels


@torch.no_grad()
def evaluate_variants(
    accelerator: Accelerator,
    model: ProteinMPNN,
    variants: RecordSet,
    labels: Sequence[float],
    decoding_order: str,
    seed: int,
) -> dict[str, float]:
    """`eval_spearman`: mean over structures of Spearman's correlation between the conditional
    `delta_logp` and the label (and its median, `eval_spearman_median`); structure groups are shared out
    over the ranks and every rank gets the same result."""
    dataset = ExampleDataset(variants)
    groups = group_variants(dataset)[accelerator.process_index :: accelerator.num_processes]
    records = [index for group in groups for index in group.records]
    mine = conditional_deltas(model, dataset, accelerator.device, decoding_order, seed, records=records)
    deltas = dict(pair for part in gather_object([mine]) for pair in part.items())
    indices = np.array(sorted(deltas))
    table = spearman_by_structure(
        np.array([deltas[i] for i in indices]),
        np.asarray(labels, dtype=np.float64)[indices],
        column(variants.records, "structure_id")[indices],
    )
    mean, median = mean_and_median(table)
    return {"eval_spearman": mean, "eval_spearman_median": median}
