"""The batch a fitted campaign measures next. On single mutants (many positions): the ridge ensemble's highest
draws. On a library of few positions: the predictor family chosen by cross-validation
(`dpo_inv.campaign.predictors`), the batch shared between its draws and the zero-shot ranking's unmeasured
top by how each has done (`dpo_inv.campaign.portfolio`), and the predictor's share exploring
(`dpo_inv.campaign.exploring`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpo_inv.campaign.acquisition import (
    MAX_PAIR_POSITIONS,
    Acquisition,
    acquisition_values,
    fit_ensemble,
    top_batch,
)
from dpo_inv.campaign.exploring import exploring_batch
from dpo_inv.campaign.portfolio import Portfolio, records, split
from dpo_inv.campaign.predictors import DEFAULT_FAMILIES, Library, choose_family


@dataclass(frozen=True)
class Choice:
    """A batch: the picked candidates (indices, best first) and what picked each (the rule, `far` or
    `zero_shot`), the predictor's mean and uncertainty for every candidate (its members' spread and its
    error beyond it, in quadrature), which predictor and why, and on a library of few positions the batch's
    split between the predictor and the zero-shot top."""

    picked: np.ndarray
    rules: list[str]
    mean: np.ndarray
    uncertainty: np.ndarray
    predictor: str
    portfolio: Portfolio | None = None


def choose_batch(measured: np.ndarray, values: np.ndarray, measured_scores: np.ndarray,
                 candidates: np.ndarray, candidate_scores: np.ndarray, parent: np.ndarray, batch: int,
                 rule: Acquisition,
                 members: int = 10, fit_seed: int = 0, draw_seed: int = 0,
                 pairwise: bool = True, positional: bool = True, ca: np.ndarray | None = None,
                 substituted: bool = True, taken: int = 0,
                 families: tuple[str, ...] = DEFAULT_FAMILIES) -> Choice:  # fmt: skip
    """The batch of ``candidates`` that ``rule`` picks from a predictor fitted on the measured variants; the
    model scores are ``[N]`` or ``[N, S]`` (several models; the first the zero-shot score); ``ca``: the
    residues' Cα coordinates, for nearness features; the first ``taken`` candidates are in the batch
    already (predicted, not picked). On a library of few positions (``pairwise`` and at most
    `MAX_PAIR_POSITIONS` varied) the predictor is the family of ``families`` chosen by cross-validation and
    the batch a portfolio; elsewhere the ridge ensemble (``pairwise``, ``positional``, ``substituted``: its
    features)."""
    measured_scores = measured_scores.reshape(len(measured), -1)
    candidate_scores = candidate_scores.reshape(len(candidates), -1)
    varied = np.flatnonzero((measured != parent[None, :]).any(0))
    if not (pairwise and 1 < len(varied) <= MAX_PAIR_POSITIONS):
        ensemble = fit_ensemble(measured, values, measured_scores, parent, members, fit_seed, pairwise,
                                positional, ca, substituted)  # fmt: skip
        predictions = ensemble.predict(candidates, candidate_scores)
        draws = acquisition_values(predictions[:, taken:], rule, draw_seed)
        uncertainty = np.sqrt(predictions.var(0) + ensemble.error**2)
        return Choice(top_batch(draws, batch) + taken, [rule] * batch, predictions.mean(0), uncertainty,
                      "ridge ensemble")  # fmt: skip
    library = Library(measured, values, measured_scores, parent, ca)
    chosen = choose_family(library, families, members, fit_seed)
    predictions = chosen.predictor.predict(candidates, candidate_scores)
    uncertainty = np.sqrt(predictions.var(0) + chosen.predictor.error**2)
    draws = acquisition_values(predictions[:, taken:], rule, draw_seed)
    zero_shot = candidate_scores[taken:, 0]
    shares = split(batch, *records(values, measured_scores[:, 0], zero_shot, chosen.out_of_fold))
    first = top_batch(zero_shot, shares.zero_shot)
    masked = draws.copy()
    masked[first] = -np.inf  # the predictor's share from the rest
    rest, rules = exploring_batch(
        masked, candidates[taken:, varied], measured[:, varied], values, shares.predictor, rule
    )
    picked = np.concatenate([first, rest])
    rules = ["zero_shot"] * len(first) + rules
    order = np.argsort(-draws[picked], kind="stable")
    return Choice(picked[order] + taken, [rules[i] for i in order], predictions.mean(0), uncertainty,
                  chosen.why(), shares)  # fmt: skip
