"""The low-N baseline of Hsu et al. (Nat. Biotechnol. 2022): ridge regression on one-hot sequences, and the
augmented model, one-hot plus a model's score as one more, unpenalised feature. Closed form, in NumPy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpo_inv.models.variants import spearman

ALPHAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)  # ridge penalties tried by the inner cross-validation
INNER_FOLDS = 5


def one_hot(tokens: np.ndarray, vocab_size: int = 21) -> np.ndarray:
    """``[R, L]`` token indices as ``[R, L * vocab_size]`` one-hot features."""
    R, L = tokens.shape
    features = np.zeros((R, L * vocab_size))
    features[np.arange(R)[:, None], np.arange(L) * vocab_size + tokens] = 1.0
    return features


@dataclass(frozen=True)
class Ridge:
    """A fitted linear model: ``features @ weights + intercept``."""

    weights: np.ndarray
    intercept: float
    alpha: float

    def predict(self, features: np.ndarray) -> np.ndarray:
        return features @ self.weights + self.intercept


def fit_ridge(features: np.ndarray, labels: np.ndarray, alpha: float, unpenalised: int = 0) -> Ridge:
    """Ridge regression (``alpha > 0``) with an unpenalised intercept; the last ``unpenalised`` columns are
    not penalised either. Solved in the dual (``records x records``) when there are fewer records than
    features, as there are at low N."""
    mean_x, mean_y = features.mean(0), labels.mean()
    X, y = features - mean_x, labels - mean_y
    split = X.shape[1] - unpenalised
    if len(y) >= X.shape[1]:
        penalty = np.r_[np.full(split, alpha), np.zeros(unpenalised)]
        weights = np.linalg.solve(X.T @ X + np.diag(penalty), X.T @ y)
    else:
        penalised, free = X[:, :split], X[:, split:]
        inverse = np.linalg.inv(penalised @ penalised.T + alpha * np.eye(len(y)))
        beta = np.linalg.lstsq(free.T @ inverse @ free, free.T @ inverse @ y, rcond=None)[0]
        weights = np.r_[penalised.T @ inverse @ (y - free @ beta), beta]
    return Ridge(weights, float(mean_y - mean_x @ weights), alpha)


def fit_ridge_cv(features: np.ndarray, labels: np.ndarray, unpenalised: int = 0, seed: int = 0) -> Ridge:
    """Ridge with the penalty of `ALPHAS` whose out-of-fold predictions rank ``labels`` best (Spearman) in
    a random `INNER_FOLDS`-fold split; refitted on everything."""
    folds = np.random.default_rng(seed).permutation(len(labels)) % min(INNER_FOLDS, len(labels))
    best, best_alpha = -np.inf, ALPHAS[0]
    for alpha in ALPHAS:
        predicted = np.zeros(len(labels))
        for fold in np.unique(folds):
            held_out = folds == fold
            model = fit_ridge(features[~held_out], labels[~held_out], alpha, unpenalised)
            predicted[held_out] = model.predict(features[held_out])
        rho = spearman(predicted, labels)
        if np.isfinite(rho) and rho > best:
            best, best_alpha = rho, alpha
    return fit_ridge(features, labels, best_alpha, unpenalised)


def augmented_features(tokens: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """One-hot features of the sequences with the model's score as the last column."""
    return np.hstack([one_hot(tokens), np.asarray(scores, dtype=np.float64)[:, None]])
