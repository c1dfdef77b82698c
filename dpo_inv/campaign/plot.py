"""The picture of a campaign, `campaign.png` in its folder: every value measured, round by round, with the
best so far; and each round's predictions against what came back (predicted ± uncertainty, Spearman)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpo_inv.models.variants import spearman


@dataclass(frozen=True)
class RoundOutcome:
    """What one round measured (``values``: every row of its measurements, controls included) and, for its
    proposals that were measured, what was predicted (NaN where the round was picked before any fit), the
    uncertainty, the zero-shot delta_logp and the measured value."""

    round: int
    values: np.ndarray
    predicted: np.ndarray
    uncertainty: np.ndarray
    zero_shot: np.ndarray
    measured: np.ndarray

    def predictions_spearman(self) -> float | None:
        """Spearman of predicted against measured over the measured proposals (None: too few, or none
        predicted)."""
        if len(self.measured) < 3 or np.isnan(self.predicted).any():
            return None
        rho = spearman(self.predicted, self.measured)
        return None if np.isnan(rho) else rho

    def best(self, lower_is_better: bool) -> float | None:
        """The round's best value (None: nothing measured)."""
        return float((min if lower_is_better else max)(self.values)) if len(self.values) else None

    def summary(self, lower_is_better: bool) -> dict[str, float | int | None]:
        rho = self.predictions_spearman()
        zero_shot = spearman(self.zero_shot, self.measured) if len(self.measured) >= 3 else float("nan")
        return {
            "round": self.round,
            "measured": len(self.values),
            "best": self.best(lower_is_better),
            "spearman_predicted": None if rho is None else round(rho, 3),
            "spearman_zero_shot": None if np.isnan(zero_shot) else round(float(zero_shot), 3),
        }


def plot_campaign(path: Path, outcomes: list[RoundOutcome], lower_is_better: bool, title: str) -> None:
    """Write the picture of ``outcomes`` (round 0, measurements before the campaign, included) as a PNG
    (matplotlib's ImportError where it is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rng = np.random.default_rng(0)
    best, points = None, []
    for outcome in outcomes:
        x = outcome.round + rng.uniform(-0.18, 0.18, len(outcome.values))
        left.scatter(x, outcome.values, s=9, alpha=0.55, color="#4c72b0", linewidths=0)
        here = outcome.best(lower_is_better)
        if here is not None:
            best = here if best is None else (min if lower_is_better else max)(best, here)
        if best is not None:
            points.append((outcome.round, best))
    if points:
        left.plot(*zip(*points, strict=True), "o-", color="#c44e52", label="best so far")
        left.legend(fontsize=8)
    rounds = [o.round for o in outcomes]
    left.set_xticks(rounds)
    left.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)
    before = any(o.round == 0 for o in outcomes)
    left.set_xlabel("round (0: measured before the campaign)" if before else "round")
    left.set_ylabel("measured value" + (" (lower is better)" if lower_is_better else ""))
    left.set_title("what each round measured", fontsize=10)
    left.grid(alpha=0.3)
    predicted = [o for o in outcomes if len(o.measured) and not np.isnan(o.predicted).any()]
    colors = plt.get_cmap("viridis")(np.linspace(0.1, 0.9, max(len(predicted), 1)))
    for outcome, color in zip(predicted, colors, strict=False):
        rho = outcome.predictions_spearman()
        label = f"round {outcome.round}, {len(outcome.measured)} measured"
        label += f": Spearman {rho:.2f}" if rho is not None else ""
        right.errorbar(outcome.predicted, outcome.measured, xerr=outcome.uncertainty, fmt="o", markersize=3,
                       elinewidth=0.6, alpha=0.7, color=color, label=label)  # fmt: skip
    if predicted:
        low = min(min(o.predicted.min(), o.measured.min()) for o in predicted)
        high = max(max(o.predicted.max(), o.measured.max()) for o in predicted)
        right.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--")
        right.legend(fontsize=8)
    else:
        note = "no round picked by the predictor\nhas been measured yet"
        right.text(0.5, 0.5, note, ha="center", va="center", transform=right.transAxes, fontsize=9)
    right.set_xlabel("predicted ± uncertainty")
    right.set_ylabel("measured")
    right.set_title("predictions against what came back", fontsize=10)
    right.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
