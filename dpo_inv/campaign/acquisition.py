"""What to measure next: an ensemble predictor of the measured value and the rule that picks a batch.

The predictor is ridge regression on the residues at the positions a campaign varies (one-hot), whether each
is mutated (what the single mutants at one position share), how near in space each mutation lies to each of
those positions (what mutations in one region of the structure share), either their pairs (one-hot of each
pair of positions: the epistasis a library of a few sites is made of) or, where the positions are too many
for pairs, how many mutations are to each amino acid (what mutations to one residue share, wherever they
are), and model scores as unpenalised features (the zero-shot score, and an adapted model's); `members` fits
on bootstrap resamples of the measurements give a mean and a spread. A prediction's uncertainty is that
spread and the error cross-validation finds beyond it (what the members agree on and still get wrong on
measurements they were not fitted on). The batch is the B candidates not yet measured with the highest
draw: Thompson sampling (each candidate's value drawn from one member), UCB (mean + spread) or greedy (mean)
(`dpo_inv.campaign.batch`).
Before there is anything to fit on, the batch is the zero-shot score's: three quarters covering the residues
of the space, a quarter its best (`zero_shot_batch`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from dpo_inv.tools.ridge import cross_validated, fit_ridge

Acquisition = Literal["thompson", "ucb", "greedy"]
MAX_PAIR_POSITIONS = 12  # pair features only where the measured variants vary at most this many positions
FIRST_AT_RANDOM = 0.5  # the share of a first batch drawn at random (docs/campaigns.md: measured)
ROWS_PER_CHUNK = 65_536  # candidates compared with the parent at a time (a [rows, L] mask)
NEAR_ANGSTROM = 10.0  # a mutation's weight on a position d Å away (Cα to Cα): exp(-d² / (2 · 10²))


def nearness(ca: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``[L, M]``: how near each residue is to each of ``positions``, exp(-d² / 2σ²) between Cα atoms
    (``ca [L, 3]``; NaN where unobserved: weight 0), 0 from a position to itself."""
    distance = np.linalg.norm(ca[:, None, :] - ca[None, positions, :], axis=-1)
    near = np.nan_to_num(np.exp(-(distance**2) / (2 * NEAR_ANGSTROM**2)))
    near[positions, np.arange(len(positions))] = 0.0
    return near


def shared_features(variants: np.ndarray, parent: np.ndarray, near: np.ndarray, substituted: bool,
                    vocab: int = 21) -> np.ndarray:  # fmt: skip
    """``[R, M + A]``: what mutations at different positions share, per variant: the sum over its mutations
    of their nearness (``near [L, M]``) to M positions, and (A = ``vocab`` where ``substituted``, else 0)
    how many of its mutations are to each residue."""
    M = near.shape[1]
    out = np.zeros((len(variants), M + (vocab if substituted else 0)))
    for start in range(0, len(variants), ROWS_PER_CHUNK):  # a chunk's [rows, L] mask at a time
        chunk = variants[start : start + ROWS_PER_CHUNK]
        changed = chunk != parent[None, :]
        block = out[start : start + ROWS_PER_CHUNK]
        if M:
            positions = np.flatnonzero(changed.any(0))
            block[:, :M] = changed[:, positions].astype(np.float64) @ near[positions]
        if substituted:
            row, position = np.nonzero(changed)
            counts = np.bincount(row * vocab + chunk[row, position], minlength=len(chunk) * vocab)
            block[:, M:] = counts.reshape(len(chunk), vocab)
    return out


@dataclass(frozen=True)
class VariantColumns:
    """Column indices of the features of variants at ``positions``: one-hot residues, whether each position
    is mutated (``positional``: what single mutants at one position share) and one-hot pairs
    (``pairwise``)."""

    positions: np.ndarray
    parent: np.ndarray  # the parent's tokens at the positions
    pairwise: bool
    positional: bool
    vocab: int = 21

    @property
    def num_features(self) -> int:
        m, v = len(self.positions), self.vocab
        pairs = m * (m - 1) // 2 * v * v if self.pairwise else 0
        return m * v + (m if self.positional else 0) + pairs

    def columns(self, variants: np.ndarray) -> np.ndarray:
        """``[R, C]`` the feature columns set to 1 for each variant (``[R, L]`` tokens; a column past the
        last feature is a placeholder, set for no feature)."""
        tokens = variants[:, self.positions].astype(np.int64)
        m, v = tokens.shape[1], self.vocab
        columns = [k * v + tokens[:, k] for k in range(m)]
        offset = m * v
        if self.positional:
            unset = self.num_features
            columns += [np.where(tokens[:, k] != self.parent[k], offset + k, unset) for k in range(m)]
            offset += m
        if self.pairwise:
            for a, b in itertools.combinations(range(m), 2):
                columns.append(offset + tokens[:, a] * v + tokens[:, b])
                offset += v * v
        return np.stack(columns, 1)

    def dense(self, variants: np.ndarray) -> np.ndarray:
        features = np.zeros((len(variants), self.num_features + 1))
        np.put_along_axis(features, self.columns(variants), 1.0, 1)
        return features[:, :-1]


@dataclass(frozen=True)
class Ensemble:
    """Ridge models fitted on bootstrap resamples: ``weights [E, F + M + A + S]`` (the one-hot columns, the
    nearness to the M varied positions, the mutations to each of A residues (A = 0: none), the S model
    scores) and ``intercepts [E]``; ``error``: the root-mean-square error of out-of-fold predictions beyond
    the members' spread on the measurements."""

    columns_of: VariantColumns
    weights: np.ndarray
    intercepts: np.ndarray
    score_scales: np.ndarray  # [S]
    parent: np.ndarray  # [L]
    near: np.ndarray  # [L, M]: nearness of each residue to the M varied positions (M = 0: none)
    substituted: bool  # whether the mutations to each residue are features
    error: float
    out_of_fold: np.ndarray  # [N]: the cross-validated predictions of the measured values

    def predict(self, variants: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """``[E, R]``: each member's prediction for each variant (``scores [R, S]``)."""
        columns = self.columns_of.columns(variants)
        shared = shared_features(variants, self.parent, self.near, self.substituted, self.columns_of.vocab)
        F = self.columns_of.num_features
        out = np.empty((len(self.weights), len(variants)))
        for e, (weights, intercept) in enumerate(zip(self.weights, self.intercepts, strict=True)):
            table = np.append(weights[:F], 0.0)  # the placeholder column weighs nothing
            out[e] = table[columns].sum(1) + shared @ weights[F : F + shared.shape[1]]
            out[e] += scores / self.score_scales @ weights[F + shared.shape[1] :] + intercept
        return out


def fit_ensemble(variants: np.ndarray, values: np.ndarray, scores: np.ndarray, parent: np.ndarray,
                 members: int = 10, seed: int = 0, pairwise: bool = True, positional: bool = True,
                 ca: np.ndarray | None = None, substituted: bool = True) -> Ensemble:  # fmt: skip
    """Fit the ensemble on measured ``variants [N, L]`` with ``values [N]`` (higher = better) and their
    model scores ``[N, S]`` (unpenalised), with nearness features where the residues' Cα coordinates
    ``ca [L, 3]`` are given, and the mutations to each residue where ``substituted`` and the positions are
    too many for pair features; the penalty is chosen once by cross-validation on all of them, whose
    out-of-fold predictions give the error beyond the spread."""
    varied = np.flatnonzero((variants != parent[None, :]).any(0))
    pairwise = pairwise and 1 < len(varied) <= MAX_PAIR_POSITIONS
    substituted = substituted and not pairwise  # a library of few positions has its pairs instead
    columns_of = VariantColumns(varied, parent[varied], pairwise, positional)
    near = np.zeros((len(parent), 0)) if ca is None else nearness(ca, varied)
    scales = np.std(scores, axis=0)
    scales[scales == 0] = 1.0
    shared = shared_features(variants, parent, near, substituted, columns_of.vocab)
    features = np.hstack([columns_of.dense(variants), shared, scores / scales])
    alpha, out_of_fold = cross_validated(features, values, scores.shape[1], seed)
    rng = np.random.default_rng(seed)
    weights, intercepts = [], []
    for _ in range(members):
        rows = rng.integers(len(values), size=len(values)) if members > 1 else np.arange(len(values))
        ridge = fit_ridge(features[rows], values[rows], alpha, scores.shape[1])
        weights.append(ridge.weights)
        intercepts.append(ridge.intercept)
    ensemble = Ensemble(
        columns_of,
        np.array(weights),
        np.array(intercepts),
        scales,
        parent,
        near,
        substituted,
        0.0,
        out_of_fold,
    )
    beyond = np.mean((values - out_of_fold) ** 2) - np.mean(ensemble.predict(variants, scores).var(0))
    return replace(ensemble, error=float(np.sqrt(max(beyond, 0.0))))


def acquisition_values(predictions: np.ndarray, rule: Acquisition, seed: int = 0) -> np.ndarray:
    """What the batch is chosen by, from the members' predictions ``[E, R]``."""
    if rule == "thompson":
        draw = np.random.default_rng(seed).integers(len(predictions), size=predictions.shape[1])
        return predictions[draw, np.arange(predictions.shape[1])]
    mean = predictions.mean(0)
    return mean + predictions.std(0) if rule == "ucb" else mean


def top_batch(values: np.ndarray, batch: int) -> np.ndarray:
    """Indices of the ``batch`` highest ``values``, best first (ties: the earlier candidate)."""
    return np.argsort(-values, kind="stable")[:batch]


def zero_shot_batch(candidates: np.ndarray, scores: np.ndarray, parent: np.ndarray,
                    batch: int, seed: int = 0,
                    at_random: float | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """A first batch before any measurement: where the candidates combine mutations, ``at_random`` of it
    (default `FIRST_AT_RANDOM`) drawn at random (seeded by ``seed``), so that the predictor learns from
    variants the zero-shot ``scores`` did not choose (on single mutants none: each is its own context); of
    the rest three quarters cover the space, each the best-scored candidate holding one residue at one
    varied position that no pick holds yet (the residues whose best candidate scores highest first), and a
    quarter are the best-scored candidates not yet picked. Returns the picked indices and how each was
    picked (`random`, `zero_shot_coverage`, `zero_shot`), best-scored first."""
    combined = ((candidates != parent[None, :]).sum(1) > 1).any()
    share = (FIRST_AT_RANDOM if at_random is None else at_random) if combined else 0.0
    chance = np.random.default_rng(seed).choice(len(scores), int(round(share * batch)), replace=False)
    original, scores = scores, scores.copy()
    scores[chance] = np.inf  # first in every ordering below: the residues they hold are covered
    order = np.argsort(-scores, kind="stable")
    varied = np.flatnonzero((candidates != parent[None, :]).any(0))
    best_holding = []  # per (position, residue): the best-scored candidate holding it
    for position in varied:
        _, first = np.unique(candidates[order, position], return_index=True)
        best_holding.append(order[first])
    holders = np.unique(np.concatenate(best_holding))
    holders = holders[~np.isin(holders, chance)]
    covering = holders[np.argsort(-scores[holders], kind="stable")][: 3 * (batch - len(chance)) // 4]
    rest = order[~np.isin(order, np.concatenate([chance, covering]))][: batch - len(chance) - len(covering)]
    picked = np.concatenate([chance, covering, rest])
    rules = np.array(
        ["random"] * len(chance) + ["zero_shot_coverage"] * len(covering) + ["zero_shot"] * len(rest)
    )
    order = np.argsort(-original[picked], kind="stable")
    return picked[order], rules[order]
