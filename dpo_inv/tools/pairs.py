"""Preference pairs, or KTO labels, from scored sequences: `dpo_inv.make_pairs` in Python, and what
`python -m dpo_inv pairs` writes."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import datasets
import numpy as np

from dpo_inv.data.dataset import VARIANTS, RecordSet, load_records, normalise, residue_score_list
from dpo_inv.data.proteingym import StructureOptions, complete_records
from dpo_inv.data.records import (
    Data,
    DataError,
    Record,
    as_table,
    raise_bad_records,
    read_records,
    rebase_paths,
    records_folder,
    write_jsonl,
)
from dpo_inv.errors import OptionError
from dpo_inv.models.weights import model_parse_options
from dpo_inv.structures.parse import PROTEINMPNN_PARSE

if TYPE_CHECKING:
    import pandas

STRATEGIES = {
    "best_vs_worst": "i-th best against i-th worst of each group",
    "all": "every pair of each group",
    "top_vs_rest": "each of the top_k best against every sequence outside the top_k",
    "same_position": "single mutants (wildtype_seq) against other mutants at the same position",
}


@dataclass
class PairsFiles:
    """What `python -m dpo_inv pairs` reads and writes."""

    output: str = field(
        metadata={"help": "Output pairs (JSONL); a relative pdb_file is made relative to its folder."}
    )
    data: str | None = field(default=None, metadata={"help": "The scored sequences, instead of SCORED_FILE."})


@dataclass(kw_only=True)
class PairingOptions:
    """How the scored sequences of a group are paired: the options `pairs` and `rounds` (a target's samples
    of a round, by their reward) share."""

    strategy: Literal["best_vs_worst", "all", "top_vs_rest", "same_position"] = field(
        default="best_vs_worst",
        metadata={"help": "; ".join(f"{k}: {v}" for k, v in STRATEGIES.items()) + " (pairs only)"},
    )
    min_margin: float = field(
        default=0.0,
        metadata={"help": "Least score difference of a pair; a pair also needs a difference > 0 (no ties)."},
    )
    max_pairs_per_structure: int | None = field(
        default=None,
        metadata={"help": "Keep at most this many pairs per group (rounds: per target and round), a seeded "
                  "random subset."},
    )  # fmt: skip
    top_k: int = field(default=1, metadata={"help": "top_vs_rest: how many of the best to pair."})

    def check_pairing(self) -> None:
        """Refuse a margin, top_k or pair limit out of range."""
        if not math.isfinite(self.min_margin) or self.min_margin < 0:
            raise OptionError(f"--min_margin must be a finite number >= 0, got {self.min_margin}")
        if self.top_k < 1:
            raise OptionError(f"--top_k must be >= 1, got {self.top_k}")
        if self.max_pairs_per_structure is not None and self.max_pairs_per_structure < 1:
            raise OptionError(f"--max_pairs_per_structure must be >= 1, got {self.max_pairs_per_structure}")


@dataclass(kw_only=True)
class PairsOptions(StructureOptions, PairingOptions):
    """How pairs are made: the options of `make_pairs` in Python, and the command's besides its files."""

    score_field: str = field(default="score", metadata={"help": "The numeric field to compare."})
    lower_is_better: bool = field(default=False, metadata={"help": "A lower score is better (e.g. ddG)."})
    wildtype_score: float | None = field(
        default=None, metadata={"help": "same_position: pair the wild type too, with this score."}
    )
    residue_score_field: str | None = field(
        default=None, metadata={"help": "Per-residue score list to carry as (un)preferred_residue_scores."}
    )
    weight_by_margin: bool = field(
        default=False, metadata={"help": "Add a weight proportional to the margin, mean 1 over the file."}
    )
    labels_from_score: float | None = field(
        default=None,
        metadata={
            "help": "Write labelled sequences instead of pairs: desirable when the score is at least this "
            "(at most, with --lower_is_better)."
        },
    )
    labels_from_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Write labelled sequences instead of pairs: desirable when better than this quantile of "
            "its group's scores (0.5: the better half of each structure's sequences)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the subsets of max_pairs_per_structure."})
    model: str | None = field(
        default=None,
        metadata={
            "help": "The model the pairs are for, when a LigandMPNN model: its residues are LigandMPNN's "
            "(modified amino acids count)."
        },
    )


@dataclass
class PairsConfig(PairsOptions, PairsFiles):
    """`python -m dpo_inv pairs`: its files, then its options."""


@dataclass(frozen=True)
class Scored:
    """One sequence of a group; `value` is its score made higher-is-better."""

    sequence: str
    score: float
    value: float
    wildtype: str | None = None
    position: int | None = None  # same_position: where the sequence differs from its wild type
    residue_scores: list[float] | None = None


Pair = tuple[Scored, Scored]  # (preferred, unpreferred)


def _number(value: Any, name: str, text_ok: bool) -> float:
    """A finite number; text is accepted only from CSV, where every cell is text."""
    if value is None:
        raise DataError(
            f"missing score field {name!r}; add a number to every record or name it with --score_field"
        )
    if text_ok and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"score field {name!r} is not a number: {value!r}; write a number")
    if not math.isfinite(value):
        raise DataError(f"score field {name!r} is {value!r}; give a finite number or leave the record out")
    return float(value)


def _mutation(sequence: str, wildtype: Any) -> int:
    """The one position where a single mutant differs from its wild type."""
    if not isinstance(wildtype, str) or not wildtype:
        raise DataError("missing wildtype_seq, which --strategy same_position needs; add the wild type")
    differ = [i for i, (a, b) in enumerate(zip(sequence, wildtype, strict=True)) if a != b]
    if len(differ) != 1:
        raise DataError(
            f"sequence differs from wildtype_seq at {len(differ)} positions {differ[:5]}; --strategy "
            "same_position needs single mutants: leave the record out or use another strategy"
        )
    return differ[0]


def _scored(record: dict, config: PairsOptions, text_ok: bool) -> Scored:
    """One valid record (load_records has checked its sequences) with its score; a ValueError says why not."""
    sequence, wildtype = record["sequence"], record.get("wildtype_seq")
    score = _number(record.get(config.score_field), config.score_field, text_ok)
    position = _mutation(sequence, wildtype) if config.strategy == "same_position" else None
    residue_scores = None
    if config.residue_score_field:
        field_name = config.residue_score_field
        residue_scores = residue_score_list(record.get(field_name), field_name, len(sequence))
    value = -score if config.lower_is_better else score
    return Scored(sequence, score, value, wildtype or None, position, residue_scores)


@dataclass
class Group:
    """The distinct scored sequences of one (structure, chains), and the group's first record as read."""

    first: dict
    items: list[Scored] = field(default_factory=list)
    sequences: set[str] = field(default_factory=set)


def read_groups(
    records: list[Record], loaded: RecordSet, config: PairsOptions
) -> tuple[dict[int, Group], int]:
    """The groups by structure id, and how many duplicate sequences were merged. Every bad record is
    reported, in file order, with load_records' reason (structure, sequences) if any, else the score's."""
    index = {record.location: i for i, record in enumerate(records)}
    problems = {index[bad.location]: bad.reason for bad in loaded.skipped}
    usable = [i for i in range(len(records)) if i not in problems]
    text_ok = Path(loaded.source).suffix.lower() == ".csv"
    groups: dict[int, Group] = {}
    merged = 0
    for i, sid in zip(usable, loaded.records["structure_id"], strict=True):
        data = normalise(records[i].data)
        try:
            item = _scored(data, config, text_ok)
        except ValueError as err:
            problems[i] = str(err)
            continue
        group = groups.setdefault(sid, Group(data))
        if item.sequence in group.sequences:
            merged += 1
            continue
        group.sequences.add(item.sequence)
        group.items.append(item)
    if problems:
        raise_bad_records([f"{records[i].location}: {problems[i]}" for i in sorted(problems)])
    return groups, merged


def _ranked(items: list[Scored]) -> list[Scored]:
    return sorted(items, key=lambda item: -item.value)  # stable: ties keep file order


def _all_pairs(items: list[Scored], ok: Callable[[Scored, Scored], bool]) -> list[Pair]:
    ranked = _ranked(items)
    return [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1 :] if ok(a, b)]


def group_pairs(items: list[Scored], config: PairsOptions) -> list[Pair]:
    """The pairs of one structure group, in the strategy's order."""

    def ok(a: Scored, b: Scored) -> bool:
        return a.value - b.value > 0 and a.value - b.value >= config.min_margin

    if config.strategy == "all":
        return _all_pairs(items, ok)
    ranked = _ranked(items)
    if config.strategy == "best_vs_worst":
        n = len(ranked)
        return [(ranked[i], ranked[n - 1 - i]) for i in range(n // 2) if ok(ranked[i], ranked[n - 1 - i])]
    if config.strategy == "top_vs_rest":
        return [(a, b) for a in ranked[: config.top_k] for b in ranked[config.top_k :] if ok(a, b)]
    positions: dict[tuple[str | None, int | None], list[Scored]] = {}
    for item in items:
        positions.setdefault((item.wildtype, item.position), []).append(item)
    pairs = []
    for (wildtype, position), mutants in positions.items():
        if config.wildtype_score is not None:
            value = -config.wildtype_score if config.lower_is_better else config.wildtype_score
            mutants = [Scored(wildtype, config.wildtype_score, value, wildtype, position), *mutants]
        pairs += _all_pairs(mutants, ok)
    return pairs


def _pair_record(pair: Pair, structure: dict, config: PairsOptions) -> dict:
    preferred, unpreferred = pair
    out = {
        **structure,
        "preferred_seq": preferred.sequence,
        "unpreferred_seq": unpreferred.sequence,
        "preferred_score": preferred.score,
        "unpreferred_score": unpreferred.score,
        "score_margin": preferred.value - unpreferred.value,
    }
    if preferred.wildtype and preferred.wildtype == unpreferred.wildtype:
        out["wildtype_seq"] = preferred.wildtype
    if config.strategy == "same_position":
        out["mutable_positions"] = [preferred.position]
    if config.residue_score_field:
        out["preferred_residue_scores"] = preferred.residue_scores
        out["unpreferred_residue_scores"] = unpreferred.residue_scores
    return out


def _structure_fields(structures: datasets.Dataset, sid: int, first: dict) -> dict:
    """pdb_file and the chains as the group's first record gives them."""
    row = structures[sid]
    design, fixed = row["design_chains"], row["fixed_chains"]
    out: dict[str, Any] = {"pdb_file": first["pdb_file"]}
    if first.get("chain_id") not in (None, ""):
        out["chain_id"] = design[0]
    else:
        out["design_chains"] = design
    if fixed:
        out["fixed_chains"] = fixed
    return out


def group_labels(items: list[Scored], config: PairsOptions) -> list[bool]:
    """Desirable or not, for each sequence of one group."""
    if config.labels_from_score is not None:
        threshold = -config.labels_from_score if config.lower_is_better else config.labels_from_score
        return [item.value >= threshold for item in items]
    cut = float(np.quantile([item.value for item in items], config.labels_from_quantile))
    return [item.value > cut for item in items]


def _labelled_record(item: Scored, desirable: bool, structure: dict, config: PairsOptions) -> dict:
    out = {**structure, "sequence": item.sequence, "label": desirable, "score": item.score}
    if item.wildtype:
        out["wildtype_seq"] = item.wildtype
    if config.residue_score_field:
        out["residue_scores"] = item.residue_scores
    return out


def check_options(config: PairsOptions) -> None:
    if config.labels_from_score is not None and config.labels_from_quantile is not None:
        raise OptionError("give --labels_from_score or --labels_from_quantile, not both")
    if config.labels_from_score is not None and not math.isfinite(config.labels_from_score):
        raise OptionError(f"--labels_from_score must be a finite number, got {config.labels_from_score}")
    if config.labels_from_quantile is not None and not 0 <= config.labels_from_quantile < 1:
        raise OptionError(f"--labels_from_quantile must be in [0, 1), got {config.labels_from_quantile}")
    config.check_pairing()
    if config.wildtype_score is not None:
        if config.strategy != "same_position":
            raise OptionError("--wildtype_score applies only to --strategy same_position")
        if not math.isfinite(config.wildtype_score):
            raise OptionError(f"--wildtype_score must be a finite number, got {config.wildtype_score}")
        if config.residue_score_field:
            raise OptionError(
                "--wildtype_score cannot go with --residue_score_field (no wild-type residue scores)"
            )


def pair_rows(data: Data, config: PairsOptions, name: str = "scored") -> tuple[list[dict], dict]:
    """The pairs (or labelled sequences) of the scored sequences of `data` (a file or records in memory),
    with `pdb_file` as the records give it, and the summary."""
    check_options(config)
    records = read_records(data, name)
    given = config.given_structure(data)
    if given is not None:
        records = complete_records(records, given)
    options = model_parse_options(config.model) if config.model else PROTEINMPNN_PARSE
    loaded = load_records(
        data, config.cache_dir, kind=VARIANTS, on_bad_record="skip", options=options, name=name,
        given=given,
    )  # fmt: skip
    groups, merged = read_groups(records, loaded, config)
    rng = random.Random(config.seed)
    structures = loaded.structures.select_columns(["path", "design_chains", "fixed_chains"])
    rows = []
    labelling = config.labels_from_score is not None or config.labels_from_quantile is not None
    for sid, group in groups.items():
        structure = _structure_fields(structures, sid, group.first)
        if labelling:
            labels = group_labels(group.items, config)
            labelled = zip(group.items, labels, strict=True)
            rows += [_labelled_record(item, label, structure, config) for item, label in labelled]
            continue
        pairs = group_pairs(group.items, config)
        limit = config.max_pairs_per_structure
        if limit is not None and len(pairs) > limit:
            pairs = [pairs[i] for i in sorted(rng.sample(range(len(pairs)), limit))]
        rows += [_pair_record(pair, structure, config) for pair in pairs]
    summary = {"records": len(records), "groups": len(groups)}
    if labelling:
        desirable = sum(row["label"] for row in rows)
        if desirable in (0, len(rows)):
            label = "desirable" if desirable else "undesirable"
            raise DataError(
                f"{loaded.source}: every one of the {len(rows)} sequences is {label}; KTO needs both labels: "
                "choose another --labels_from_score or --labels_from_quantile"
            )
        return rows, {**summary, "sequences": len(rows), "desirable": desirable, "merged_duplicates": merged}
    if not rows:
        raise DataError(
            f"{loaded.source}: no pairs: no two sequences of one group differ in score by > 0 and >= "
            f"--min_margin {config.min_margin} ({len(records)} records, {len(groups)} groups); give a "
            "smaller --min_margin"
        )
    mean_margin = sum(row["score_margin"] for row in rows) / len(rows)
    if config.weight_by_margin:
        for row in rows:
            row["weight"] = row["score_margin"] / mean_margin
    return rows, {**summary, "pairs": len(rows), "merged_duplicates": merged,
                  "mean_margin": float(f"{mean_margin:.4g}"), "strategy": config.strategy}  # fmt: skip


def make_pairs(scored: Data, **options: Any) -> list[dict] | pandas.DataFrame:
    """Preference pairs from scored sequences, as `python -m dpo_inv pairs` writes them, or sequences
    labelled desirable or not (for kto) with `labels_from_score` or `labels_from_quantile`; `options` are
    the command's others (:class:`PairsOptions`: `strategy`, `score_field`, `lower_is_better`, `min_margin`,
    ...), with its defaults.

    `scored` is a data file, a list of dicts, a pandas DataFrame or a `datasets.Dataset` of sequences with
    their structure and a number in `score_field` (e.g. the records `dpo-inv score` or `dpo-inv sample`
    return). Sequences are grouped by structure and chains; `strategy` is one of: best_vs_worst (i-th best
    against i-th worst of each group), all, top_vs_rest (the `top_k` best against the others),
    same_position (single mutants against other mutants at the same position). A pair needs a score
    difference > 0 and >= `min_margin`. `pdb_file` is absolute (a relative one was relative to the
    working directory). Returns a DataFrame when `scored` is one,
    else a list of dicts; bad records raise one `DataError` (a `ValueError`), a line each.
    """
    config = PairsOptions(**options)
    rows, _ = pair_rows(scored, config)
    return as_table(scored, rebase_paths(rows, records_folder(scored), None))


def pairs_file(config: PairsConfig) -> dict:
    """`python -m dpo_inv pairs`: read `config.data`, write the pairs to `config.output` (a relative
    pdb_file relative to its folder, an absolute one as it was), return the summary."""
    output = Path(config.output)
    rows, summary = pair_rows(config.data, config)
    write_jsonl(output, rebase_paths(rows, records_folder(config.data), output.parent))
    return {**summary, "output": str(output)}
