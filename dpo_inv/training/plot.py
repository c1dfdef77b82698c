"""Training curves from metrics.jsonl and rounds.jsonl as PNG files (needs matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

# figure name -> the metrics it shows; each is drawn for training and, where logged, for evaluation
FIGURES = {
    "loss": ("loss",),
    "reward_accuracy": ("rewards/accuracies",),
    "reward_margin": ("rewards/margins",),
    "rewards": ("rewards/chosen", "rewards/rejected"),
    "logps": ("logps/chosen", "logps/rejected"),
    "recovery": ("recovery",),
    "kl": ("kl",),
    "learning_rate": ("learning_rate",),
}


def show_changes_at_scale(axes, values: list[float]) -> None:
    """A y axis at least a tenth of the values' size tall, without an offset: 0.4255 to 0.4262 draws as
    the flat line it is, not as a fall across the figure."""
    low, high = min(values), max(values)
    least = 0.1 * max(abs(low), abs(high))
    if high - low < least:
        middle = (low + high) / 2
        axes.set_ylim(middle - least / 2, middle + least / 2)
    axes.ticklabel_format(axis="y", useOffset=False)


def plot(output_dir: str | Path) -> list[Path]:
    """Write one PNG per figure into `output_dir/plots`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    events = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    (output_dir / "plots").mkdir(exist_ok=True)
    written = []
    for name, metrics in FIGURES.items():
        series = []
        for metric in metrics:
            for prefix, style in (("", "-"), ("eval_", "o-")):
                points = [(e["step"], e[prefix + metric]) for e in events if prefix + metric in e]
                if points:
                    series.append((f"{'eval ' if prefix else 'train '}{metric}", style, points))
        if not series:
            continue
        figure, axes = plt.subplots(figsize=(6, 4))
        for label, style, points in series:
            axes.plot(*zip(*points, strict=True), style, label=label, markersize=3)
        show_changes_at_scale(axes, [value for *_, points in series for _, value in points])
        axes.set_xlabel("optimizer step")
        axes.set_title(name.replace("_", " "))
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = output_dir / "plots" / f"{name}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


ROUND_FIGURES = (("reward", ("mean_reward", "median_reward", "best_reward")), ("recovery", ("recovery",)),
                 ("diversity", ("diversity",)))  # fmt: skip


def plot_rounds(output_dir: str | Path) -> Path:
    """Reward, recovery and diversity of the samples by round, from rounds.jsonl: `plots/rounds.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    output_dir = Path(output_dir)
    lines = [json.loads(line) for line in (output_dir / "rounds.jsonl").read_text().splitlines() if line]
    figure, axes = plt.subplots(1, len(ROUND_FIGURES), figsize=(12, 3.5))
    for ax, (title, metrics) in zip(axes, ROUND_FIGURES, strict=True):
        for metric in metrics:
            ax.plot([line["round"] for line in lines], [line[metric] for line in lines], "o-", label=metric)
        show_changes_at_scale(ax, [line[metric] for line in lines for metric in metrics])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("sampling pass (round)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    (output_dir / "plots").mkdir(exist_ok=True)
    path = output_dir / "plots" / "rounds.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
