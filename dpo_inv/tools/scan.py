"""The map designers look at: every single substitution at a structure's designed positions, scored by a
model (and by the predictor an adapt run fitted), with per-position sensitivity; and ProteinMPNN's
conditional probabilities (`--conditional_probs_only`).

Each substitution's `delta_logp` is the conditional score `score` gives a single mutant: the position
decoded last given every other residue, log p(mutant) - log p(wild type).
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpo_inv.data.batches import collate
from dpo_inv.data.design import DesignSpace, read_design_space
from dpo_inv.errors import OptionError
from dpo_inv.models.mpnn import ProteinMPNN, derive_seed
from dpo_inv.models.options import ModelOptions, ScoringOrderOptions, check_signs
from dpo_inv.models.variants import conditional_log_probs, round_metric
from dpo_inv.models.weights import as_model
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS
from dpo_inv.tools.heatmap import plot_scan
from dpo_inv.tools.ridge import AugmentedRidge
from dpo_inv.tools.score import check_ridge
from dpo_inv.training.launch import resolve_device

FILES = ("scan.csv", "positions.csv", "heatmap.png", "conditional_probs.npz")


@dataclass
class ScanFiles:
    """What `python -m dpo_inv scan` reads and writes."""

    structure: str = field(metadata={"help": "PDB/mmCIF file (gzipped too)."})
    output_dir: str = field(metadata={"help": "Folder for scan.csv, positions.csv, heatmap.png and "
                                              "conditional_probs.npz."})  # fmt: skip
    model: str = field(
        default="vanilla/v_48_020", metadata={"help": "Model name, .pt file or saved directory."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace the files of an earlier scan."})


@dataclass(kw_only=True)
class ScanOptions(ModelOptions, ScoringOrderOptions):
    """What is scanned, and how: the options of `scan` in Python, and the command's besides its files."""

    chain_id: list[str] = field(default_factory=list, metadata={"help": "Designed chains (default: all)."})
    positions: str = field(
        default="",
        metadata={"help": 'Positions to scan, in ProteinMPNN\'s syntax with author numbers: "A:39-60,75" '
                  "(default: every observed residue of the designed chains)."},
    )  # fmt: skip
    ridge: str | None = field(
        default=None,
        metadata={"help": "The augmented_ridge.json adapt wrote beside its final model (--model): adds "
                  "predicted_<label>, and the heatmap shows it."},
    )  # fmt: skip
    num_orders: int = field(default=1, metadata={"help": "Decoding orders; log p is averaged over them."})
    seed: int = field(default=42, metadata={"help": "Seed of the random decoding order (score's seed)."})

    def __post_init__(self) -> None:
        check_signs(self, positive=("num_orders",), non_negative=("seed",))


@dataclass
class ScanConfig(ScanOptions, ScanFiles):
    """`python -m dpo_inv scan`: its files, then its options."""


@dataclass
class Scan:
    """A scanned structure: its designed chains' sequence, the scanned positions and the model's
    log-probabilities there, each position decoded last (``[P, 21]``)."""

    space: DesignSpace
    log_probs: np.ndarray
    example: dict
    predicted: np.ndarray | None = None  # [P, 21] the ridge's predicted label of each substitution
    label: str = ""  # the field the ridge predicts
    lower_is_better: bool = False  # of that label

    @property
    def deltas(self) -> np.ndarray:
        """``[P, 21]``: log p(amino acid) - log p(wild type) at each scanned position (0 at the wild type)."""
        wildtype = self.space.parent[self.space.positions]
        return self.log_probs - self.log_probs[np.arange(len(wildtype)), wildtype][:, None]

    @property
    def gains(self) -> np.ndarray:
        """``[P, 21]``: how much better than the wild type each substitution is, higher = better: the
        predicted label's change with a ridge (its sign turned where lower is better), else `deltas`."""
        if self.predicted is None:
            return self.deltas
        wildtype = self.space.parent[self.space.positions]
        gains = self.predicted - self.predicted[np.arange(len(wildtype)), wildtype][:, None]
        return -gains if self.lower_is_better else gains

    def rows(self) -> list[dict]:
        """One row per substitution, in ProteinGym's columns: `mutant` (`K23G`, author numbering as
        `propose` writes mutations), `mutated_sequence` (the designed chains), `delta_logp`, and with a
        ridge `predicted_<label>`; then the position (`A23`) and the amino acids."""
        rows = []
        deltas = self.deltas
        for row, position in enumerate(self.space.positions):
            for letter in AMINO_ACIDS:
                token = ALPHABET.index(letter)
                if token == self.space.parent[position]:
                    continue
                variant = self.space.parent.copy()
                variant[position] = token
                record = {
                    "mutant": self.space.mutations(variant),
                    "mutated_sequence": "".join(ALPHABET[t] for t in variant),
                    "delta_logp": round(float(deltas[row, token]), 4),
                }
                if self.predicted is not None:
                    record[f"predicted_{self.label}"] = round(float(self.predicted[row, token]), 4)
                chain, number = self.space.numbers[position]
                rows.append(record | {"position": f"{chain}{number}", "wildtype": ALPHABET[self.space.parent[
                    position]], "mutation": letter})  # fmt: skip
        return rows

    def position_rows(self) -> list[dict]:
        """Per scanned position: the wild type's log p, the entropy of the model's distribution there, the
        mean `delta_logp` of its 19 substitutions (the more negative, the less the model tolerates change)
        and its best substitution."""
        probs = np.exp(self.log_probs[:, :20])
        probs = probs / probs.sum(1, keepdims=True)
        deltas, gains = self.deltas, self.gains
        rows = []
        for row, position in enumerate(self.space.positions):
            wildtype = int(self.space.parent[position])
            others = [t for t in range(20) if t != wildtype]
            best = max(others, key=lambda t: gains[row, t])
            chain, number = self.space.numbers[position]
            record = {
                "position": f"{chain}{number}",
                "wildtype": ALPHABET[wildtype],
                "wildtype_logp": round(float(self.log_probs[row, wildtype]), 4),
                "entropy": round(float(-(probs[row] * np.log(probs[row])).sum()), 4),
                "mean_delta_logp": round(float(deltas[row, others].mean()), 4),
                "best_mutant": f"{ALPHABET[wildtype]}{self.space.labels[position]}{ALPHABET[best]}",
                "best_delta_logp": round(float(deltas[row, best]), 4),
            }
            if self.predicted is not None:
                record[f"mean_predicted_{self.label}"] = round(float(self.predicted[row, others].mean()), 4)
                record[f"best_predicted_{self.label}"] = round(float(self.predicted[row, best]), 4)
            rows.append(record)
        return rows


def scan_structure(model: ProteinMPNN | str, structure: str | Path, config: ScanOptions) -> Scan:
    """Score every single substitution at ``positions`` (default: every observed designed residue)."""
    model = as_model(model)
    fitted = None if config.ridge is None else AugmentedRidge.load(config.ridge)
    decoding_order = config.scoring_order(fitted.decoding_order if fitted else None)
    if fitted is not None:  # on single mutants the joint estimator is the conditional one
        check_ridge(fitted, model, str(config.ridge), fitted.variant_scoring, decoding_order)
    space, example = read_design_space(
        str(structure), config.chain_id, config.positions, options=config.parse_options(model.config)
    )
    torch_device = resolve_device(config.device)
    model = model.to(torch_device).eval()
    batch = {k: v.to(torch_device) for k, v in collate([{**example, "wildtype": example["native"]}]).items()}
    # the order `score` draws for a structure's variants listed first: a scan's rows give the same deltas
    order = None if decoding_order == "left_to_right" else derive_seed(config.seed, 0, 0)
    log_probs = conditional_log_probs(model, batch, space.positions.tolist(), order, config.num_orders)
    result = Scan(space, log_probs.cpu().numpy().astype(np.float64), example)
    if fitted is not None:
        result.predicted = predicted_table(result, fitted, structure)
        result.label, result.lower_is_better = fitted.score_field, fitted.lower_is_better
    return result


def predicted_table(scan: Scan, ridge: AugmentedRidge, structure: str | Path) -> np.ndarray:
    """``[P, 21]``: the ridge's predicted label of each single substitution (the wild type's at its own)."""
    wildtype = "".join(ALPHABET[t] for t in scan.space.parent)
    if wildtype not in ridge.proteins:
        fitted_on = ", ".join(sorted({protein.pdb_file for protein in ridge.proteins.values()}))
        raise OptionError(
            f"{structure}: its designed chains ({len(wildtype)} residues) are not a wild type the ridge was "
            f"fitted on ({fitted_on}): scan without --ridge, or give the structure and chains adapt used"
        )
    deltas = scan.deltas
    predicted = np.zeros_like(deltas)
    for row, position in enumerate(scan.space.positions):
        variants = np.repeat(scan.space.parent[None], len(ALPHABET), 0)
        variants[:, position] = np.arange(len(ALPHABET))
        predicted[row] = ridge.predict(wildtype, variants, deltas[row])
    return predicted


def scan(model: ProteinMPNN | str, structure: str | Path, **options: Any) -> list[dict]:
    """Every single substitution at the `positions` of ``structure``'s designed chains (`chain_id`;
    default: all), scored as `scan` scores them: the rows of its `scan.csv` (`mutant`,
    `mutated_sequence`, `delta_logp`, with a `ridge` `predicted_<label>`, `position`, `wildtype`,
    `mutation`); `options` are the command's others (:class:`ScanOptions`), with its defaults."""
    return scan_structure(model, structure, ScanOptions(**options)).rows()


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_conditional_probs(path: Path, result: Scan) -> None:
    """ProteinMPNN's `--conditional_probs_only` file: `log_p` ``[1, L, 21]`` (zero where not scanned), the
    native sequence `S`, `mask` and `design_mask` over the structure's residues (designed chains first)."""
    length = len(result.example["native"])
    log_p = np.zeros((1, length, len(ALPHABET)), dtype=np.float32)
    log_p[0, result.space.positions] = result.log_probs
    design_mask = np.zeros(length, dtype=np.float32)
    design_mask[result.space.positions] = 1
    native, mask = np.asarray(result.example["native"]), np.asarray(result.example["mask"])
    np.savez(path, log_p=log_p, S=native, mask=mask, design_mask=design_mask, alphabet=np.array(ALPHABET))


def scan_file(config: ScanConfig) -> dict:
    """`scan`: write the scan's files into `output_dir`; returns the summary the command prints."""
    output = Path(config.output_dir)
    existing = [name for name in FILES if (output / name).exists()]
    if existing and not config.overwrite:
        raise OptionError(f"{output} holds an earlier scan ({', '.join(existing)}); give another "
                         "--output_dir, or --overwrite to replace it")  # fmt: skip
    result = scan_structure(config.model, config.structure, config)
    output.mkdir(parents=True, exist_ok=True)
    rows = result.rows()
    write_csv(output / "scan.csv", rows)
    write_csv(output / "positions.csv", result.position_rows())
    write_conditional_probs(output / "conditional_probs.npz", result)
    written = ["scan.csv", "positions.csv", "conditional_probs.npz"]
    try:
        plot_scan(output / "heatmap.png", result, Path(config.structure).name)
        written.append("heatmap.png")
    except ImportError:
        print("scan: heatmap.png needs matplotlib: pip install matplotlib", file=sys.stderr)
    key = "delta_logp" if result.predicted is None else f"predicted_{result.label}"
    best = (min if result.lower_is_better else max)(rows, key=lambda row: row[key])
    return {
        "structure": config.structure,
        "positions": len(result.space.positions),
        "substitutions": len(rows),
        "best": {"mutant": best["mutant"], key: round_metric(best[key])},
        "output_dir": str(output),
        "files": written,
    }
