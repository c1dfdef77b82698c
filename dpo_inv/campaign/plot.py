"""The picture of a campaign, `campaign.png` in its folder: every value measured, round by round, with the
best so far; and each round's predictions against what came back (the latest round's with their uncertainty,
each round's Spearman in the legend); a colour per round, the parent's measured value a line on both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def plot_campaign(path: Path, outcomes: list[RoundOutcome], lower_is_better: bool, title: str,
                  parent_value: float | None = None) -> None:  # fmt: skip
    """Write the picture of ``outcomes`` (round 0, measurements before the campaign, included), a colour per
    round and the parent's measured value (``parent_value``, where it was measured) a line on both panels, as
    a PNG (matplotlib's ImportError where it is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
    colors = round_colors([o.round for o in outcomes])
    measured_panel(left, outcomes, colors, lower_is_better)
    predicted = predictions_panel(right, outcomes, colors)
    if parent_value is not None:
        for axes in (left, right) if predicted else (left,):
            axes.axhline(
                parent_value, color="#c44e52", linewidth=1, linestyle="-.", label="parent (measured)"
            )
    handles, labels = left.get_legend_handles_labels()
    for handle, label in zip(*right.get_legend_handles_labels(), strict=True):
        if label not in labels:  # the parent's line is on both panels
            handles.append(handle)
            labels.append(label)
    columns = min(len(labels), 3 if len(labels) <= 9 else 4)
    figure.legend(handles, labels, loc="outside lower center", ncol=columns, fontsize=8, frameon=False,
                  markerscale=1.5)  # fmt: skip
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=130)
    plt.close(figure)


def measured_panel(
    axes: Any, outcomes: list[RoundOutcome], colors: dict[int, Any], lower_is_better: bool
) -> None:
    """What each round measured, jittered around its round, and the best so far."""
    from matplotlib.ticker import MaxNLocator

    rng = np.random.default_rng(0)
    best, points = None, []
    for outcome in outcomes:
        rho = outcome.predictions_spearman()
        label = f"round {outcome.round}" + (" (before the campaign)" if outcome.round == 0 else "")
        label += f": {len(outcome.values)} measured" + (f", Spearman {rho:.2f}" if rho is not None else "")
        x = outcome.round + rng.uniform(-0.18, 0.18, len(outcome.values))
        axes.scatter(x, outcome.values, s=12, alpha=0.7, color=colors[outcome.round], linewidths=0,
                     label=label)  # fmt: skip
        here = outcome.best(lower_is_better)
        if here is not None:
            best = here if best is None else (min if lower_is_better else max)(best, here)
        if best is not None:
            points.append((outcome.round, best))
    if points:
        axes.plot(*zip(*points, strict=True), "o-", color="black", markersize=4, linewidth=1.2,
                  label="best so far")  # fmt: skip
    rounds = [o.round for o in outcomes]
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)
    axes.set_xlabel("round")
    axes.set_ylabel("measured value" + (" (lower is better)" if lower_is_better else ""))
    axes.set_title("what each round measured", fontsize=10)
    axes.grid(alpha=0.3)


def predictions_panel(axes: Any, outcomes: list[RoundOutcome], colors: dict[int, Any]) -> list[RoundOutcome]:
    """Each round's predictions against what came back, the last round's uncertainty as bars; returns the
    rounds drawn (those picked by the predictor and measured)."""
    predicted = [o for o in outcomes if len(o.measured) and not np.isnan(o.predicted).any()]
    for outcome in predicted[:-1]:  # earlier rounds: their points alone
        axes.scatter(outcome.predicted, outcome.measured, s=16, alpha=0.55, color=colors[outcome.round],
                     linewidths=0)  # fmt: skip
    if predicted:
        last = predicted[-1]
        axes.errorbar(last.predicted, last.measured, xerr=last.uncertainty, fmt="none", elinewidth=0.7,
                      alpha=0.35, color=colors[last.round])  # fmt: skip
        axes.scatter(last.predicted, last.measured, s=26, color=colors[last.round], edgecolors="black",
                     linewidths=0.5, zorder=3)  # fmt: skip
        low = min(min(o.predicted.min(), o.measured.min()) for o in predicted)
        high = max(max(o.predicted.max(), o.measured.max()) for o in predicted)
        axes.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--",
                  label="predicted = measured")  # fmt: skip
        axes.set_xlabel(f"predicted (bars: round {last.round}'s uncertainty)")
    else:
        note = "no round picked by the predictor\nhas been measured yet"
        axes.text(0.5, 0.5, note, ha="center", va="center", transform=axes.transAxes, fontsize=9)
        axes.set_xlabel("predicted")
        axes.set_xticks([])
        axes.set_yticks([])
    axes.set_ylabel("measured")
    axes.set_title("predictions against what came back", fontsize=10)
    axes.grid(alpha=0.3)
    return predicted


def round_colors(rounds: list[int]) -> dict[int, Any]:
    """A colour per round: grey for round 0 (before the campaign), the others distinct (tab10 up to ten
    rounds, else along viridis)."""
    from matplotlib import colormaps

    later = [n for n in rounds if n > 0]
    palette = (colormaps["tab10"].colors if len(later) <= 10
               else colormaps["viridis"](np.linspace(0.05, 0.9, len(later))))  # fmt: skip
    return {0: "#8c8c8c"} | {n: palette[i] for i, n in enumerate(later)}
