"""The predictor families a campaign on a library of few positions chooses among, by cross-validation on its
own measurements: the ridge ensemble (`dpo_inv.campaign.acquisition.fit_ensemble`), boosted trees and a
network ensemble (the families ALDE uses; on the residues at the varied positions, one-hot, and the model
scores), and a model of which variants are alive (most of a library is dead: the ridge ensemble's chance of
being alive times its value where alive). Each is an ensemble of bootstrap fits; the family chosen is the
one whose out-of-fold predictions put the best measured values first (the mean value of its top tenth)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from dpo_inv.campaign.acquisition import Ensemble, fit_ensemble
from dpo_inv.errors import OptionError

FAMILIES = ("ridge", "trees", "network", "alive")
DEFAULT_FAMILIES = ("ridge", "alive")  # docs/campaigns.md: the others measured, behind on most landscapes
FOLDS = 5
TOP_SHARE = 0.1  # a family is judged by the values of its out-of-fold top tenth (at least MIN_TOP)
MIN_TOP = 5
ALIVE_SHARE = 0.05  # alive: a value above the lowest by more than this share of the range measured
VOCAB = 21


class Predictor(Protocol):
    """A fitted family: each member's prediction ``[E, R]`` of variants ``[R, L]`` with scores ``[R, S]``."""

    error: float

    def predict(self, variants: np.ndarray, scores: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Library:
    """What a family is fitted on: the measured variants ``[N, L]``, their values and model scores
    ``[N, S]``, the parent and the residues' Cα coordinates (for the ridge ensemble's nearness)."""

    variants: np.ndarray
    values: np.ndarray
    scores: np.ndarray
    parent: np.ndarray
    ca: np.ndarray | None

    def rows(self, keep: np.ndarray) -> Library:
        return replace(self, variants=self.variants[keep], values=self.values[keep], scores=self.scores[keep])


@dataclass(frozen=True)
class SiteMembers:
    """Bootstrap fits of one regressor on the one-hot residues at ``positions`` and the scaled scores."""

    positions: np.ndarray
    scales: np.ndarray
    models: list[Any]
    error: float = 0.0

    def features(self, variants: np.ndarray, scores: np.ndarray) -> np.ndarray:
        tokens = variants[:, self.positions].astype(np.int64)
        one_hot = np.zeros((len(variants), len(self.positions) * VOCAB), np.float32)
        np.put_along_axis(one_hot, tokens + VOCAB * np.arange(len(self.positions)), 1.0, 1)
        return np.hstack([one_hot, (scores / self.scales).astype(np.float32)])

    def predict(self, variants: np.ndarray, scores: np.ndarray) -> np.ndarray:
        features = self.features(variants, scores)
        return np.stack([model.predict(features) for model in self.models]).astype(np.float64)


class Network:
    """A small multilayer perceptron (two hidden layers of 32), trained full-batch on standardised values."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def fit(self, features: np.ndarray, values: np.ndarray) -> Network:
        torch.manual_seed(self.seed)
        self.mean, self.std = float(values.mean()), float(values.std()) or 1.0
        x, y = torch.from_numpy(features), torch.from_numpy((values - self.mean) / self.std).float()
        layers = [torch.nn.Linear(x.shape[1], 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(32, 1))
        optimizer = torch.optim.Adam(self.net.parameters(), lr=3e-3, weight_decay=1e-3)
        for _ in range(200):
            optimizer.zero_grad()
            loss = torch.mean((self.net(x)[:, 0] - y) ** 2)
            loss.backward()
            optimizer.step()
        return self

    @torch.no_grad()
    def predict(self, features: np.ndarray) -> np.ndarray:
        return self.net(torch.from_numpy(features))[:, 0].numpy() * self.std + self.mean


def regressor(family: str, seed: int) -> Any:
    if family != "trees":
        return Network(seed)
    try:
        from sklearn.ensemble import HistGradientBoostingRegressor
    except ImportError:
        raise OptionError("the predictor family trees needs scikit-learn: pip install scikit-learn") from None
    return HistGradientBoostingRegressor(max_iter=100, max_depth=4, min_samples_leaf=3, random_state=seed)


def fit_members(family: str, library: Library, members: int, seed: int) -> SiteMembers:
    """``members`` bootstrap fits of the trees or the network."""
    positions = np.flatnonzero((library.variants != library.parent).any(0))
    scales = np.std(library.scores, axis=0)
    scales[scales == 0] = 1.0
    fitted = SiteMembers(positions, scales, [])
    features = fitted.features(library.variants, library.scores)
    rng = np.random.default_rng(seed)
    for member in range(members):
        rows = rng.integers(len(library.values), size=len(library.values)) if members > 1 else slice(None)
        fitted.models.append(regressor(family, seed + member).fit(features[rows], library.values[rows]))
    return fitted


@dataclass(frozen=True)
class Alive:
    """The chance of being alive (the ridge ensemble on alive = 1, dead = 0, clipped to [0, 1]) times the
    value where alive (the ridge ensemble on the alive measurements, or their mean where they are few)."""

    chance: Ensemble
    value: Ensemble | float
    error: float = 0.0

    def predict(self, variants: np.ndarray, scores: np.ndarray) -> np.ndarray:
        chance = np.clip(self.chance.predict(variants, scores), 0.0, 1.0)
        value = self.value if isinstance(self.value, float) else self.value.predict(variants, scores)
        return chance * value


def fit_alive(library: Library, members: int, seed: int) -> Alive:
    values = library.values
    alive = values > values.min() + ALIVE_SHARE * np.ptp(values)
    chance = fit_ensemble(library.variants, alive.astype(np.float64), library.scores, library.parent, members,
                          seed, ca=library.ca)  # fmt: skip
    if alive.sum() < 8 or np.ptp(values[alive]) == 0:
        return Alive(chance, float(values[alive].mean()) if alive.any() else 0.0)
    where = library.rows(alive)
    value = fit_ensemble(where.variants, where.values, where.scores, where.parent, members, seed, ca=where.ca)
    return Alive(chance, value)


def fit_family(family: str, library: Library, members: int, seed: int) -> Predictor:
    if family == "ridge":
        return fit_ensemble(library.variants, library.values, library.scores, library.parent, members, seed,
                            ca=library.ca)  # fmt: skip
    if family == "alive":
        return fit_alive(library, members, seed)
    return fit_members(family, library, members, seed)


def out_of_fold(family: str, library: Library, seed: int) -> np.ndarray:
    """The family's predictions of each measured value by a fit (one member) on the other folds."""
    folds = np.random.default_rng(seed).permutation(len(library.values)) % FOLDS
    predicted = np.zeros(len(library.values))
    for fold in range(FOLDS):
        held_out = folds == fold
        if held_out.any():
            fitted = fit_family(family, library.rows(~held_out), 1, seed)
            predicted[held_out] = fitted.predict(library.variants[held_out], library.scores[held_out])[0]
    return predicted


def top_value(predicted: np.ndarray, values: np.ndarray) -> float:
    """The mean value of the measured variants ``predicted`` puts first (its top tenth, at least five)."""
    count = min(len(values), max(MIN_TOP, int(round(TOP_SHARE * len(values)))))
    return float(values[np.argsort(-predicted, kind="stable")[:count]].mean())


@dataclass(frozen=True)
class Chosen:
    """The family chosen, fitted on every measurement, its out-of-fold predictions and each family's
    cross-validated top value."""

    family: str
    predictor: Predictor
    out_of_fold: np.ndarray
    judged: dict[str, float]

    def why(self) -> str:
        if not self.judged:
            return f"predictor {self.family}"
        judged = ", ".join(f"{family} {value:.3g}" for family, value in self.judged.items())
        return f"predictor {self.family} (the mean value of each family's out-of-fold top tenth: {judged})"


def choose_family(library: Library, families: tuple[str, ...], members: int, seed: int) -> Chosen:
    """The family of ``families`` whose out-of-fold top is best (the first of a tie), fitted on everything,
    its uncertainty beyond the members' spread from its out-of-fold errors; the ridge ensemble alone as it
    fits itself (its penalty's cross-validation gives the out-of-fold predictions)."""
    if families == ("ridge",):
        ensemble = fit_family("ridge", library, members, seed)
        return Chosen("ridge", ensemble, ensemble.out_of_fold, {})
    predicted = {family: out_of_fold(family, library, seed) for family in families}
    judged = {family: top_value(p, library.values) for family, p in predicted.items()}
    family = max(families, key=lambda f: judged[f])
    fitted = fit_family(family, library, members, seed)
    spread = fitted.predict(library.variants, library.scores).var(0).mean()
    beyond = np.mean((library.values - predicted[family]) ** 2) - spread
    return Chosen(family, replace(fitted, error=float(np.sqrt(max(beyond, 0.0)))), predicted[family], judged)
