"""The round function: a campaign's state and its scorer in, the next batch out. `propose` calls it with the
models on a folder's measurements; `scripts/campaign_benchmark.py` with a simulated lab."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from dpo_inv.campaign.acquisition import Acquisition, zero_shot_batch
from dpo_inv.campaign.batch import choose_batch
from dpo_inv.campaign.predictors import DEFAULT_FAMILIES
from dpo_inv.data.design import variant_keys
from dpo_inv.errors import OptionError
from dpo_inv.tools.adapt import Adapted, AdaptOptions

MIN_MEASURED = 8  # fewer measurements: the batch is the zero-shot score's (`zero_shot_batch`)


class Scorer(Protocol):
    """What a round asks of the models (`dpo_inv.campaign.scoring.ModelScorer`)."""

    def zero_shot(self, variants: np.ndarray) -> np.ndarray: ...

    def adapt(self, measured: np.ndarray, values: np.ndarray, seed: int) -> Adapted: ...

    def adapted(self, adapted: Adapted, variants: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class RoundSettings:
    """How a batch is picked (`propose`'s options of the same names)."""

    num_proposals: int
    acquisition: Acquisition = "thompson"
    members: int = 10
    adapt: Literal["auto", "yes", "no"] = "auto"
    seed: int = 0
    families: tuple[str, ...] = DEFAULT_FAMILIES  # chosen among by cross-validation on a library


@dataclass(frozen=True)
class CampaignState:
    """What a round is picked from: the parent, the space's candidates (those measured or failed are left
    out), what was measured (higher values better), what failed, the residues' Cα coordinates and the
    variants the user asks to include."""

    parent: np.ndarray  # [L] tokens
    candidates: np.ndarray  # [C, L]
    measured: np.ndarray  # [N, L]
    values: np.ndarray  # [N]
    failed: np.ndarray  # [F, L]
    ca: np.ndarray | None = None  # [L, 3]
    included: np.ndarray | None = None  # [I, L]


@dataclass(frozen=True)
class Batch:
    """The next batch, best first: its variants, what picked each and what was predicted of it (NaN before
    any fit), the zero-shot score of each and of every measured variant, and the adaptation (if one ran)."""

    variants: np.ndarray  # [B, L]
    predicted: np.ndarray  # [B]
    uncertainty: np.ndarray  # [B]
    zero_shot: np.ndarray  # [B]
    picked_by: list[str]
    why: str
    predictor: str  # which predictor picked it, and why that one
    candidates: int  # how many were left to choose from
    measured_zero_shot: np.ndarray  # [N]
    adapted: Adapted | None = None


def unmeasured(state: CampaignState) -> np.ndarray:
    """The candidates neither measured nor failed."""
    done = variant_keys(np.vstack([state.measured, state.failed]).reshape(-1, len(state.parent)))
    return state.candidates[~np.isin(variant_keys(state.candidates), done)]


def next_batch(state: CampaignState, scorer: Scorer, settings: RoundSettings) -> Batch:
    """The next batch of `settings.num_proposals` variants: those the user includes, then, from 8 measurements
    on, the ensemble's pick (adapting the model first where `settings.adapt` says so), before that the
    zero-shot score's."""
    candidates = unmeasured(state)
    included = (
        np.zeros((0, len(state.parent)), candidates.dtype) if state.included is None else state.included
    )
    if len(included):
        candidates = candidates[~np.isin(variant_keys(candidates), variant_keys(included))]
    wanted = settings.num_proposals - len(included)
    if wanted > len(candidates):
        raise OptionError(
            f"--num_proposals {settings.num_proposals}: only {len(candidates) + len(included)} candidates "
            "are left unmeasured; propose fewer or widen the design space"
        )
    measured, values = state.measured, state.values
    everything = np.vstack([included, candidates, measured.astype(candidates.dtype)])
    scores = scorer.zero_shot(everything)[:, None]
    adapted = adapt_if_asked(state, scorer, settings)
    if adapted is not None and adapted.decision == "adapted":
        tuned = scorer.adapted(adapted, np.vstack([included, candidates]))
        scores = np.hstack([scores, np.r_[tuned, adapted.out_of_fold[0]][:, None]])
    mine, rest = len(included), len(included) + len(candidates)
    if len(measured) >= MIN_MEASURED and np.ptp(values) > 0:
        seed = settings.seed + len(measured)  # each round its own bootstrap and draws
        choice = choose_batch(measured, values, scores[rest:], everything[:rest], scores[:rest], state.parent,
                              wanted, settings.acquisition, settings.members, seed, seed, ca=state.ca,
                              taken=mine, families=settings.families)  # fmt: skip
        picked, mean, uncertainty, rules = choice.picked, choice.mean, choice.uncertainty, choice.rules
        predictor = choice.predictor
        why = f"{settings.acquisition}, {settings.members} members ({len(measured)} measured"
        why += f"; model {adapted.decision})" if adapted else ")"
        why += f"; {predictor}"
        if choice.portfolio is not None:
            why += f"; {choice.portfolio.why()}"
        if "far" in rules:
            why += f"; {rules.count('far')} of the predictor's far from the best measured"
    else:
        picked, how = zero_shot_batch(candidates, scores[mine:rest, 0], state.parent, wanted, settings.seed)
        picked = picked + mine
        mean = uncertainty = np.full(rest, np.nan)
        rules = how.tolist()
        predictor = "none: the zero-shot score before any fit"
        why = (f"before any fit ({len(measured)} measured, fewer than {MIN_MEASURED}): the zero-shot joint "
               "delta_logp's best and those covering the space's residues; on combinations, half at "
               "random")  # fmt: skip
    picked = np.concatenate([np.arange(mine), picked]).astype(np.int64)
    rules = ["include"] * mine + rules
    return Batch(everything[picked], mean[picked], uncertainty[picked], scores[picked, 0], rules, why,
                 predictor, len(candidates), scores[rest:, 0], adapted)  # fmt: skip


def adapt_if_asked(state: CampaignState, scorer: Scorer, settings: RoundSettings) -> Adapted | None:
    """The adaptation of the model to the measurements, where `settings.adapt` asks for it (`auto`: where
    every measured variant is a single mutant) and there are enough to cross-validate."""
    singles = (state.measured != state.parent).sum(1).max(initial=0) <= 1
    wanted = settings.adapt == "yes" or (settings.adapt == "auto" and singles)
    if not (wanted and len(state.measured) >= AdaptOptions.min_labels and np.ptp(state.values) > 0):
        return None
    return scorer.adapt(state.measured, state.values, settings.seed)
