"""What a round writes and reads back: the batch as `proposals.csv` and `proposals.fasta`, what adapting did
(`adapt.json`), and each measured round's outcome (what was predicted of what came back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpo_inv.campaign.folder import MeasuredRound
from dpo_inv.campaign.plot import RoundOutcome
from dpo_inv.campaign.round import Batch
from dpo_inv.data.design import DesignSpace, variant_key
from dpo_inv.data.records import write_json, write_text
from dpo_inv.models.variants import round_metric
from dpo_inv.structures.parse import ALPHABET, tokenize
from dpo_inv.tools.adapt import Adapted

COLUMNS = "rank,mutations,sequence,predicted,uncertainty,zero_shot_delta_logp,picked_by"


def write_proposals(folder: Path, n: int, space: DesignSpace, batch: Batch, lower_is_better: bool) -> None:
    """`proposals.csv` and `proposals.fasta` of round ``n`` in ``folder`` (values in the lab's direction),
    and `adapt.json` with the adapted model where the round adapted one."""
    sign = -1.0 if lower_is_better else 1.0
    table, fasta = [COLUMNS], []
    for rank, (variant, mean, spread, score, rule) in enumerate(
        zip(
            batch.variants, batch.predicted, batch.uncertainty, batch.zero_shot, batch.picked_by, strict=True
        ),
        1,
    ):
        sequence = "".join(ALPHABET[t] for t in variant)
        mutations = space.mutations(variant)
        table.append(
            f"{rank},{mutations},{sequence},{_number(sign * mean)},{_number(spread)},{score:.4f},{rule}"
        )
        said = (f"predicted={sign * mean:.4f} uncertainty={spread:.4f}" if np.isfinite(mean)
                else f"zero_shot_delta_logp={score:.4f}")  # fmt: skip
        fasta.append(f">round{n}_{rank:03d} {mutations} {said}\n{sequence}\n")
    write_text(folder / "proposals.csv", "\n".join(table) + "\n")
    write_text(folder / "proposals.fasta", "".join(fasta))
    if batch.adapted is not None:
        write_json(folder / "adapt.json", adaptation_report(batch.adapted))
        if batch.adapted.decision == "adapted":
            batch.adapted.model.save_pretrained(folder / "model")


def adaptation_report(adapted: Adapted) -> dict[str, Any]:
    """What `round_N/adapt.json` says of the round's adaptation."""
    return {"decision": adapted.decision, "learning_rate": adapted.best.learning_rate,
            "max_steps": adapted.best.max_steps, "cv_spearman_start": round_metric(adapted.start_mean),
            "cv_spearman_adapted": round_metric(adapted.best.spearman),
            "cv_spearman_augmented_ridge": round_metric(adapted.ridge_mean)}  # fmt: skip


def round_outcome(measured: MeasuredRound, keys: list[bytes | None],
                  zero_shot_of: dict[bytes, float]) -> RoundOutcome:  # fmt: skip
    """What ``measured`` (its rows' variant keys ``keys``, None where outside the space) came back with and,
    for its proposals that were measured, what was predicted; for measurements made before the campaign
    (no proposals), their zero-shot scores where ``zero_shot_of`` has them."""
    value_of = {k: row.value for k, row in zip(keys, measured.rows, strict=True) if k is not None}
    values = np.array([row.value for row in measured.rows if np.isfinite(row.value)])
    if measured.proposals is None:
        known = [k for k, v in value_of.items() if k in zero_shot_of and np.isfinite(v)]
        nothing = np.full(len(known), np.nan)
        scores = np.array([zero_shot_of[k] for k in known])
        return RoundOutcome(
            measured.round, values, nothing, nothing, scores, np.array([value_of[k] for k in known])
        )
    keys = [variant_key(tokenize(row["sequence"])) for row in measured.proposals]
    found = [(row, value_of[k]) for row, k in zip(measured.proposals, keys, strict=True)
             if k in value_of and np.isfinite(value_of[k])]  # fmt: skip
    rows = [row for row, _ in found]
    return RoundOutcome(measured.round, values, _column(rows, "predicted"), _column(rows, "uncertainty"),
                        _column(rows, "zero_shot_delta_logp"), np.array([v for _, v in found]))  # fmt: skip


def _column(rows: list[dict[str, str]], name: str) -> np.ndarray:
    """A number column of proposals.csv rows (NaN where empty)."""
    return np.array([float(row[name]) if row[name] else np.nan for row in rows])


def _number(value: float) -> str:
    return "" if not np.isfinite(value) else f"{value:.4f}"
