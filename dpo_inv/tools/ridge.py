"""The low-N baseline of Hsu et al. (Nat. Biotechnol. 2022): ridge regression on one-hot sequences, and the
augmented model, one-hot plus a model's score as one more, unpenalised feature. Closed form, in NumPy; the
fitted augmented models of `dpo-inv adapt` are saved and read here (`AugmentedRidge`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpo_inv.data.records import DataError, write_json
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


def cross_validated(
    features: np.ndarray, labels: np.ndarray, unpenalised: int = 0, seed: int = 0
) -> tuple[float, np.ndarray]:
    """The penalty of `ALPHAS` whose out-of-fold predictions rank ``labels`` best (Spearman) in a random
    `INNER_FOLDS`-fold split, and those predictions."""
    folds = np.random.default_rng(seed).permutation(len(labels)) % min(INNER_FOLDS, len(labels))
    chosen: tuple[float, float, np.ndarray] | None = None  # (Spearman, penalty, predictions)
    for alpha in ALPHAS:
        predicted = np.zeros(len(labels))
        for fold in np.unique(folds):
            held_out = folds == fold
            model = fit_ridge(features[~held_out], labels[~held_out], alpha, unpenalised)
            predicted[held_out] = model.predict(features[held_out])
        rho = spearman(predicted, labels)
        if chosen is None or (np.isfinite(rho) and rho > chosen[0]):  # the first where none ranks
            chosen = (rho if np.isfinite(rho) else -np.inf, alpha, predicted)
    return chosen[1], chosen[2]


def fit_ridge_cv(features: np.ndarray, labels: np.ndarray, unpenalised: int = 0, seed: int = 0) -> Ridge:
    """Ridge with the penalty `cross_validated` chooses, fitted on everything."""
    return fit_ridge(features, labels, cross_validated(features, labels, unpenalised, seed)[0], unpenalised)


def augmented_features(tokens: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """One-hot features of the sequences with the model's score as the last column."""
    return np.hstack([one_hot(tokens), np.asarray(scores, dtype=np.float64)[:, None]])


RIDGE_FILE = "augmented_ridge.json"  # written by `dpo-inv adapt`, read by `dpo-inv score --ridge`


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter of `model`: an augmented ridge holds only for the model whose score it
    was fitted on."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ProteinRidge:
    """The augmented ridge model of one wild type's variants."""

    pdb_file: str
    labelled: int
    ridge: Ridge


@dataclass(frozen=True)
class AugmentedRidge:
    """Augmented ridge models on one model's `delta_logp`, one per wild type (keyed by its
    residues as letters); they predict the label in the user's units and direction (`score_field`)."""

    model: str
    fingerprint: str
    decoding_order: str
    score_field: str
    lower_is_better: bool
    proteins: dict[str, ProteinRidge]
    variant_scoring: str = "conditional"  # the estimator of delta_logp: joint where multi-mutants were fitted

    def predict(self, wildtype: str, variants: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """The predicted label of each variant (``[R, L]`` tokens) of `wildtype` from its `delta_logp`: the
        augmented model's prediction, summed position by position rather than through ``[R, L * 21]``
        features."""
        ridge = self.proteins[wildtype].ridge
        per_position = ridge.weights[:-1].reshape(len(wildtype), -1)
        predicted = per_position[np.arange(len(wildtype)), variants].sum(1)
        predicted = predicted + ridge.weights[-1] * np.asarray(deltas, dtype=np.float64) + ridge.intercept
        return -predicted if self.lower_is_better else predicted

    def save(self, path: str | Path) -> None:
        names = ("model", "fingerprint", "decoding_order", "variant_scoring", "score_field")
        header = {k: getattr(self, k) for k in names}
        proteins = [
            {
                "wildtype": wildtype,
                "pdb_file": protein.pdb_file,
                "labelled": protein.labelled,
                "alpha": protein.ridge.alpha,
                "intercept": protein.ridge.intercept,
                "delta_logp_weight": float(protein.ridge.weights[-1]),
                "one_hot_weights": protein.ridge.weights[:-1].reshape(len(wildtype), -1).tolist(),
            }
            for wildtype, protein in self.proteins.items()
        ]
        write_json(path, {**header, "lower_is_better": self.lower_is_better, "proteins": proteins})

    @classmethod
    def load(cls, path: str | Path) -> AugmentedRidge:
        """Read what `save` wrote; anything else is a `DataError` naming the file."""
        try:
            content = json.loads(Path(path).read_text())
            proteins = {
                p["wildtype"]: ProteinRidge(
                    p["pdb_file"],
                    int(p["labelled"]),
                    Ridge(
                        np.r_[np.ravel(p["one_hot_weights"]), p["delta_logp_weight"]],
                        float(p["intercept"]),
                        float(p["alpha"]),
                    ),
                )
                for p in content["proteins"]
            }
            return cls(content["model"], content["fingerprint"], content["decoding_order"],
                       content["score_field"], bool(content["lower_is_better"]), proteins,
                       content.get("variant_scoring", "conditional"))  # fmt: skip
        except FileNotFoundError:
            raise DataError(f"{path}: no such file: give the {RIDGE_FILE} that dpo-inv adapt wrote") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(
                f"{path}: not an augmented ridge file written by dpo-inv adapt ({type(err).__name__}: {err})"
            ) from None
