"""The heatmap of a scan: positions by amino acids, each cell how much better than the wild type that
substitution scores (blue better, red worse, the wild type dotted), with each position's mean over its
substitutions (its tolerance of change) above; rows of 100 positions, so that 50 to 500 residues read."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpo_inv.structures.parse import ALPHABET

if TYPE_CHECKING:
    from dpo_inv.tools.scan import Scan

ORDER = "RHKDESTNQCGPAVILMFYW"  # charged, polar, special, hydrophobic, aromatic: the usual order of DMS maps
PER_ROW = 100  # at most this many positions per row of the figure
CELL = 0.13  # inches per position


def plot_scan(path: Path, scan: Scan, title: str) -> None:
    """Write the heatmap of ``scan`` as a PNG (matplotlib's ImportError where it is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [ALPHABET.index(a) for a in ORDER]
    gains = scan.gains[:, tokens].T  # [20, P]
    positions = scan.space.positions
    wildtype = scan.space.parent[positions]
    others = np.ones_like(gains, dtype=bool)
    others[[ORDER.index(ALPHABET[t]) for t in wildtype], np.arange(len(positions))] = False
    limit = float(np.quantile(np.abs(gains[others]), 0.99)) or 1.0
    tolerance = np.where(others, gains, np.nan)
    tolerance = np.nanmean(tolerance, 0)
    rows = math.ceil(len(positions) / PER_ROW)
    width = math.ceil(len(positions) / rows)
    figure = plt.figure(figsize=(max(6.0, 1.6 + width * CELL), 4.4 * rows))
    grid = figure.add_gridspec(3 * rows, 2, height_ratios=[0.7, 3.4, 0.8] * rows, width_ratios=[1, 0.02],
                               hspace=0.08, wspace=0.02)  # fmt: skip
    labels = [f"{ALPHABET[t]}{scan.space.labels[p]}" for t, p in zip(wildtype, positions, strict=True)]
    step = 1 if width <= 50 else 5
    image = None
    for row in range(rows):
        columns = slice(row * width, min((row + 1) * width, len(positions)))
        count = columns.stop - columns.start
        track = figure.add_subplot(grid[3 * row, 0])
        values = tolerance[columns]
        track.bar(np.arange(count), values, width=0.9, color=np.where(values < 0, "#b2182b", "#2166ac"))
        track.set_xlim(-0.5, width - 0.5)
        track.set_xticks([])
        track.set_ylabel("mean", fontsize=7)
        track.tick_params(labelsize=6)
        track.axhline(0, color="black", linewidth=0.5)
        axis = figure.add_subplot(grid[3 * row + 1, 0])
        image = axis.imshow(gains[:, columns], cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto",
                            interpolation="nearest")  # fmt: skip
        dots = np.argwhere(~others[:, columns])
        axis.scatter(dots[:, 1], dots[:, 0], s=4, color="black", marker="o", linewidths=0)
        axis.set_xlim(-0.5, width - 0.5)
        axis.set_yticks(range(len(ORDER)), list(ORDER), fontsize=6)
        ticks = [i for i in range(count) if (columns.start + i) % step == 0]
        axis.set_xticks(ticks, [labels[columns.start + i] for i in ticks], rotation=90, fontsize=6)
        if row == 0:
            track.set_title(title, fontsize=9, loc="left")
    what = "Δ log p" if scan.predicted is None else f"predicted Δ{scan.label}"
    turned = scan.predicted is not None and scan.lower_is_better
    direction = " (lower is better: sign turned)" if turned else ""
    colorbar = figure.colorbar(image, cax=figure.add_subplot(grid[1, 1]))
    colorbar.set_label(f"{what} vs wild type{direction}; blue better; • the wild type", fontsize=7)
    colorbar.ax.tick_params(labelsize=6)
    figure.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(figure)
