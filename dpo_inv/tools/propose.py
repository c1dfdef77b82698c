"""Design campaigns: propose the next batch of variants to make from what has been measured so far.

A campaign is one folder. `campaign.json` holds its design space (structure, chains, parent, positions,
allowed amino acids, at most k mutations, or a list of candidates) and the model; `round_N/proposals.csv`
and `round_N/proposals.fasta` each round's batch; `round_N/measurements.csv` what came back (any rows:
controls that were never proposed too). Each call reads every measurement, adapts the model to them
(`dpo-inv adapt`: written to `round_N/model` with `round_N/adapt.json` when cross-validation keeps it), fits
the ensemble predictor of `dpo_inv.tools.acquisition` on them over the model's joint score, and writes the
next round.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from dpo_inv.data.batches import collate, structure_inputs
from dpo_inv.data.measurements import Measurement, read_measurements, read_variants
from dpo_inv.data.records import DataError, write_json, write_text
from dpo_inv.models.combinations import MAX_ORDERS, joint_deltas, joint_plan
from dpo_inv.models.mpnn import ProteinMPNN, derive_seed
from dpo_inv.models.options import ModelOptions
from dpo_inv.models.sampling import sample_sequences
from dpo_inv.models.variants import conditional_log_probs, round_metric
from dpo_inv.models.weights import as_model
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS, tokenize
from dpo_inv.tools.acquisition import choose_batch, zero_shot_batch
from dpo_inv.tools.adapt import Adapted, AdaptOptions, choose_and_train, variant_set
from dpo_inv.tools.campaign_plot import RoundOutcome, plot_campaign
from dpo_inv.tools.design_space import MAX_CANDIDATES, DesignSpace, read_design_space
from dpo_inv.tools.reward_fn import RewardFunction, compute_rewards
from dpo_inv.tools.sample import prepare_design
from dpo_inv.training.launch import resolve_device, reuse_freed_memory

CAMPAIGN_FILE = "campaign.json"
# ProteinMPNN's four noise levels, the one adapted (the default checkpoint) first
NOISE_LEVELS = ["vanilla/v_48_020", "vanilla/v_48_002", "vanilla/v_48_010", "vanilla/v_48_030"]
MIN_MEASURED = 8  # fewer measurements: the batch is the zero-shot score's (`zero_shot_batch`)
# the adapted model trains on and scores one order of a combination's mutated positions (four: 3.4x as long)
ADAPTED_ORDERS = 1
# where the space is too large to list: this many sets of positions, this many samples on each
SAMPLED_SETS = 128
SAMPLES_PER_SET = 16
SETS_PER_PASS = 16


@dataclass
class ProposeConfig(ModelOptions):
    """The options of `python -m dpo_inv propose`, and of `propose` in Python besides the campaign and
    model."""

    campaign: str = field(metadata={"help": "The campaign folder (made by the first call)."})
    structure: str | None = field(default=None, metadata={"help": "PDB/mmCIF file (first call)."})
    chain_id: list[str] = field(default_factory=list, metadata={"help": "Designed chains (default: all)."})
    positions: str = field(
        default="",
        metadata={"help": 'Positions that may change, in ProteinMPNN\'s syntax with author numbers: '
                  '"A:39,40,54" (default: every designed position).'},
    )  # fmt: skip
    allowed_aas: str = field(
        default="",
        metadata={"help": 'Amino acids allowed: "AVILMFWY" everywhere or "39:AVILM 40:FWY" per position '
                  "(default: all 20)."},
    )  # fmt: skip
    max_mutations: int = field(default=1, metadata={"help": "At most this many mutations from the parent."})
    parent: str | None = field(
        default=None, metadata={"help": "Mutations from the structure's sequence to the parent (V39F:D40W)."}
    )
    candidates: str | None = field(
        default=None,
        metadata={"help": "A file of candidate variants (mutations, mutant or sequence) instead of a space."},
    )
    model: list[str] | None = field(
        default=None,
        metadata={"help": "Models (names, .pt files or saved directories) whose joint scores, averaged, are "
                  "the zero-shot score; the first is the one adapted and sampled from (default: "
                  "vanilla/v_48_020 where the candidates are single mutants, ProteinMPNN's four noise levels "
                  "where they combine mutations)."},
    )  # fmt: skip
    measurements: str | None = field(
        default=None, metadata={"help": "Measurements made before the campaign, copied into round_0."}
    )
    value_field: str | None = field(
        default=None, metadata={"help": "The measurements' value column (default: value or DMS_score)."}
    )
    lower_is_better: bool = field(default=False, metadata={"help": "Lower values are better."})
    batch_size: int = field(default=96, metadata={"help": "Variants to propose this round."})
    acquisition: str = field(
        default="thompson", metadata={"help": "thompson, ucb (mean + spread) or greedy (mean)."}
    )
    members: int = field(default=10, metadata={"help": "Ensemble members (bootstrap fits)."})
    adapt: Literal["auto", "yes", "no"] = field(
        default="auto",
        metadata={"help": "Adapt the model to the measurements first (dpo-inv adapt's cross-validated DPO; "
                  "the model is kept where that does not rank held-out measurements better): yes, no, or "
                  "auto: where every measured variant is a single mutant (on combinations it costs minutes "
                  "a round)."},
    )  # fmt: skip
    reward: str | None = field(
        default=None,
        metadata={"help": "Measure each round with a function instead of the lab, as dpo-inv rounds: "
                  "path/to/file.py:function or package.module:function, given records (pdb_file, "
                  "design_chains, fixed_chains, sequence), returning one number per record."},
    )  # fmt: skip
    reward_command: str | None = field(
        default=None,
        metadata={"help": "Instead of --reward: a shell command reading the records as JSON lines on stdin, "
                  "writing one number per line."},
    )  # fmt: skip
    rounds: int = field(
        default=1,
        metadata={"help": "Rounds to run, each measured by --reward or --reward_command before the next."},
    )  # fmt: skip
    seed: int = field(default=0, metadata={"help": "Seed of the bootstrap and of Thompson draws."})

    def __post_init__(self) -> None:
        if self.acquisition not in ("thompson", "ucb", "greedy"):
            raise ValueError(f"--acquisition {self.acquisition}: give thompson, ucb or greedy")
        for name in ("max_mutations", "batch_size", "members", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: give a positive number")


# what campaign.json keeps from the first call: the design space and the model (fixed), and the round
# settings (a later call that gives none of these takes the saved ones)
DESIGN_FIELDS = ("structure", "chain_id", "positions", "allowed_aas", "max_mutations", "parent", "candidates",
                 "model", "ligand_context", "ligand_exclude", "value_field", "lower_is_better")  # fmt: skip
ROUND_FIELDS = ("batch_size", "acquisition", "members", "adapt")


def settle_campaign(config: ProposeConfig) -> ProposeConfig:
    """The campaign's settings: those given to the first call (saved with its round), then those saved; a
    design option given again with another value is bad input."""
    folder = Path(config.campaign)
    path = folder / CAMPAIGN_FILE
    defaults = ProposeConfig(campaign=config.campaign)
    if not path.exists():
        if config.structure is None:
            raise ValueError(f"{folder}: no {CAMPAIGN_FILE} there: start the campaign with --structure")
        saved = {name: getattr(config, name) for name in (*DESIGN_FIELDS, *ROUND_FIELDS)}
        for name in ("structure", "candidates"):
            if saved[name] is not None:
                saved[name] = str(Path(saved[name]).resolve())
        if saved["model"]:
            saved["model"] = resolved(saved["model"])
        return ProposeConfig(**{**asdict(config), **saved})
    saved = {name: getattr(defaults, name) for name in DESIGN_FIELDS} | json.loads(path.read_text())
    if isinstance(saved["model"], str):  # a campaign started with one model
        saved["model"] = [saved["model"]]
    for name in ROUND_FIELDS:
        if getattr(config, name) != getattr(defaults, name):
            saved[name] = getattr(config, name)
    for name in DESIGN_FIELDS:
        given, default = getattr(config, name), getattr(defaults, name)
        if given != default and name in ("structure", "candidates") and given is not None:
            given = str(Path(given).resolve())
        if given != default and name == "model":
            given = resolved(given)
        if given != default and given != saved[name]:
            raise ValueError(
                f"{path}: the campaign was started with {name} = {saved[name]!r}, not "
                f"{getattr(config, name)!r}: keep the campaign's settings, or start another campaign folder"
            )
    return ProposeConfig(**{**asdict(config), **saved})


def resolved(models: list[str]) -> list[str]:
    """Model names as given, paths that exist made absolute (a campaign is read from any directory)."""
    return [str(Path(m).resolve()) if Path(m).exists() else m for m in models]


def measured_variants(space: DesignSpace, rows: list[Measurement]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[N, L]`` and values of the measured variants, one per variant: the same variant with two
    different values is bad input."""
    seen: dict[bytes, tuple[float, str]] = {}
    variants, values = [], []
    for row in rows:
        tokens = variant_tokens(space, row)
        key = tokens.tobytes()
        if key in seen:
            if seen[key][0] != row.value:
                raise DataError(
                    f"{row.location}: {row.variant or 'the parent'} measured {row.value:g} here and "
                    f"{seen[key][0]:g} at {seen[key][1]}: keep one value per variant (average replicates)"
                )
            continue
        seen[key] = (row.value, row.location)
        variants.append(tokens)
        values.append(row.value)
    return np.array(variants, dtype=np.int64).reshape(-1, len(space.parent)), np.array(values)


def variant_tokens(space: DesignSpace, row: Measurement) -> np.ndarray:
    """Tokens of the designed chains of the variant ``row`` names (its mutations or its full sequence)."""
    if row.kind == "mutations":
        return space.parse(row.variant, row.location)
    tokens = tokenize(row.variant.replace("/", "").replace(":", ""))
    if len(tokens) != len(space.parent) or (tokens < 0).any():
        raise DataError(
            f"{row.location}: the sequence has {len(tokens)} residues (or letters outside "
            f"{AMINO_ACIDS}); the designed chains have {len(space.parent)}"
        )
    return tokens


def rounds_of(folder: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("round_*") if p.name.split("_")[1].isdigit())


def read_campaign_measurements(folder: Path, config: ProposeConfig) -> list[Measurement]:
    rows = []
    for n in rounds_of(folder):
        path = folder / f"round_{n}" / "measurements.csv"
        if path.exists():
            rows += read_measurements(path, config.value_field)
    return rows


def round_outcomes(folder: Path, config: ProposeConfig, space: DesignSpace,
                   zero_shot_of: dict[bytes, float] | None = None) -> list[RoundOutcome]:  # fmt: skip
    """Each measured round's values and, for its proposals that were measured, what was predicted; for
    measurements made before the campaign (no proposals), their zero-shot scores where ``zero_shot_of``
    (a measured variant's key to its score) has them."""
    outcomes = []
    for n in rounds_of(folder):
        path = folder / f"round_{n}" / "measurements.csv"
        if not path.exists():
            continue
        measured = {_key(variant_tokens(space, row)): row.value
                    for row in read_measurements(path, config.value_field)}  # fmt: skip
        proposals = folder / f"round_{n}" / "proposals.csv"
        if not proposals.exists():  # measured before the campaign: what the zero-shot model said of it
            scores = zero_shot_of or {}
            known = [k for k in measured if k in scores]
            nothing = np.full(len(known), np.nan)
            outcomes.append(RoundOutcome(n, np.array(list(measured.values())), nothing, nothing,
                                         np.array([scores[k] for k in known]),
                                         np.array([measured[k] for k in known])))  # fmt: skip
            continue
        rows = list(csv.DictReader(proposals.open()))
        found = [(row, measured[k]) for row in rows if (k := _key(tokenize(row["sequence"]))) in measured]
        rows, values = [row for row, _ in found], [value for _, value in found]
        outcomes.append(RoundOutcome(n, np.array(list(measured.values())), _column(rows, "predicted"),
                                     _column(rows, "uncertainty"), _column(rows, "zero_shot_delta_logp"),
                                     np.array(values)))  # fmt: skip
    return outcomes


def _column(rows: list[dict[str, str]], name: str) -> np.ndarray:
    """A number column of proposals.csv rows (NaN where empty)."""
    return np.array([float(row[name]) if row[name] else np.nan for row in rows])


def draw_campaign(folder: Path, config: ProposeConfig, outcomes: list[RoundOutcome]) -> Path:
    """`campaign.png` in the campaign folder (matplotlib's ImportError where it is not installed)."""
    path = folder / "campaign.png"
    title = f"{folder.name}: {Path(config.structure or '').name} {config.positions}".strip()
    plot_campaign(path, outcomes, config.lower_is_better, title)
    return path


def plot_campaign_folder(folder: str | Path) -> Path:
    """Draw `campaign.png` of the campaign in ``folder`` (what `python -m dpo_inv plot DIR` does there)."""
    config = settle_campaign(ProposeConfig(campaign=str(folder)))
    space, _ = read_design_space(config.structure, config.chain_id, config.positions, config.allowed_aas,
                                 config.max_mutations, config.parent)  # fmt: skip
    return draw_campaign(Path(folder), config, round_outcomes(Path(folder), config, space))


def picture_or_note(draw: Callable[[], Path]) -> str | None:
    """The picture's path, or None with a note on stderr where matplotlib is not installed."""
    try:
        return str(draw())
    except ImportError:
        print("propose: campaign.png needs matplotlib: pip install matplotlib", file=sys.stderr)
        return None


def example_ca(example: dict[str, Any], length: int) -> np.ndarray:
    """``[length, 3]`` Cα coordinates of the designed chains' residues (NaN where unobserved)."""
    ca = np.asarray(example["X"], dtype=np.float64)[:length, 1].copy()
    ca[np.asarray(example["mask"])[:length] == 0] = np.nan
    return ca


def sampled(space: DesignSpace, config: ProposeConfig) -> bool:
    """Whether a round's candidates are drawn from the model: no candidates file, a space too large."""
    return config.candidates is None and space.size() > MAX_CANDIDATES


def candidate_variants(space: DesignSpace, config: ProposeConfig, model: ProteinMPNN, example: dict[str, Any],
                       device: torch.device) -> np.ndarray:  # fmt: skip
    """The variants a round chooses from (tokens as bytes): the candidates file's, every variant of the
    space, or, where the space holds more than `MAX_CANDIDATES`, variants drawn from the model."""
    if config.candidates is not None:
        variants = [variant_tokens(space, row) for row in read_variants(config.candidates)]
        return np.unique(np.array(variants, dtype=np.uint8).reshape(-1, len(space.parent)), axis=0)
    if sampled(space, config):
        return sampled_variants(model, example, space, config.seed, device).astype(np.uint8)
    return space.enumerate()


@torch.no_grad()
def sampled_variants(model: ProteinMPNN, example: dict[str, Any], space: DesignSpace, seed: int,
                     device: torch.device) -> np.ndarray:  # fmt: skip
    """Distinct variants of the space drawn from the model: `SAMPLED_SETS` sets of at most k positions,
    drawn by how much the model would change each one (its probability of an allowed substitution there,
    the rest of the parent given), then `SAMPLES_PER_SET` samples at temperature 1 with only the set
    designed; amino acids the space does not allow are left out."""
    visible = np.asarray(example["native"][len(space.parent) :])
    parent = torch.from_numpy(np.concatenate([space.parent, visible]))
    base = {**example, "native": parent, "wildtype": parent}
    batch = {k: v.to(device) for k, v in collate([base]).items()}
    probs = conditional_log_probs(model, batch, space.positions.tolist(), None).exp().cpu().numpy()
    weights = np.array([probs[i, tokens].sum() for i, tokens in enumerate(space.allowed)]) + 1e-9
    rng = np.random.default_rng(seed)
    k = min(space.max_mutations, len(space.positions))
    sets: dict[tuple[int, ...], None] = {}
    for _ in range(4 * SAMPLED_SETS):  # Gumbel top-k: k positions drawn without replacement
        keys = np.log(weights) + rng.gumbel(size=len(weights))
        sets.setdefault(tuple(sorted(space.positions[np.argsort(-keys)[:k]].tolist())))
        if len(sets) == SAMPLED_SETS:
            break
    anywhere = {int(t) for tokens in space.allowed for t in tokens}
    omit = "".join(a for a in AMINO_ACIDS if ALPHABET.index(a) not in anywhere)
    allowed = np.zeros((len(space.parent), len(ALPHABET)), dtype=bool)
    allowed[np.arange(len(space.parent)), space.parent] = True
    for position, tokens in zip(space.positions, space.allowed, strict=True):
        allowed[position, tokens] = True
    found = []
    chosen = list(sets)
    for start in range(0, len(chosen), SETS_PER_PASS):
        examples = []
        for positions in chosen[start : start + SETS_PER_PASS]:
            mutable = np.zeros(len(space.parent), np.float32)
            mutable[list(positions)] = 1
            examples.append({**base, "mutable": mutable})
        seeds = [derive_seed(seed, start + i) for i in range(len(examples))]
        samples = sample_sequences(model, collate(examples), SAMPLES_PER_SET, 1.0, seeds, omit,
                                   max_mutations=k)  # fmt: skip
        tokens = samples.tokens[:, :, : len(space.parent)].reshape(-1, len(space.parent)).cpu().numpy()
        found.append(tokens[allowed[np.arange(tokens.shape[1]), tokens].all(1)])
    variants = np.unique(np.concatenate(found), axis=0)
    return variants[(variants != space.parent).any(1)]


@torch.no_grad()
def zero_shot(model: ProteinMPNN, example: dict[str, Any], space: DesignSpace, variants: np.ndarray,
              device: torch.device, max_orders: int = MAX_ORDERS) -> np.ndarray:  # fmt: skip
    """The model's joint `delta_logp` of each variant against the parent (its mutated positions decoded in
    at most ``max_orders`` orders)."""
    batch = {k: v.to(device) for k, v in collate([example]).items()}
    enc = model.encode(**structure_inputs(batch))
    visible = np.asarray(example["native"][len(space.parent) :])  # the chains not designed
    parent = np.concatenate([space.parent, visible])
    visible_rows = np.broadcast_to(visible.astype(variants.dtype), (len(variants), len(visible)))
    variants = np.hstack([variants, visible_rows])
    plan = joint_plan(parent, variants, np.arange(len(parent)), model.config.vocab_size, max_orders)
    return joint_deltas(model, enc, torch.from_numpy(parent).to(device), plan).numpy().astype(np.float64)


def adapt_to_measurements(model: ProteinMPNN, example: dict[str, Any], space: DesignSpace,
                          measured: np.ndarray, values: np.ndarray, seed: int,
                          device: torch.device) -> Adapted:  # fmt: skip
    """`dpo-inv adapt` on the measured variants (higher values better): the model to score candidates with,
    and each measurement's score by a model that did not train on it."""
    visible = np.asarray(example["native"][len(space.parent) :])
    parent = torch.from_numpy(np.concatenate([space.parent, visible]))
    batch = {k: v.to(device) for k, v in collate([{**example, "wildtype": parent}]).items()}
    variants = np.hstack([measured, np.broadcast_to(visible, (len(measured), len(visible)))])
    config = AdaptOptions(decoding_order="left_to_right", seed=seed)
    sets = [variant_set(model, batch, variants, values, None, max_orders=ADAPTED_ORDERS)]
    return choose_and_train(model, sets, config)


def adaptation_report(adapted: Adapted) -> dict[str, Any]:
    """What `round_N/adapt.json` says of the round's adaptation."""
    return {"decision": adapted.decision, "learning_rate": adapted.best.learning_rate,
            "max_steps": adapted.best.max_steps, "cv_spearman_start": round_metric(adapted.start_mean),
            "cv_spearman_adapted": round_metric(adapted.best.spearman),
            "cv_spearman_augmented_ridge": round_metric(adapted.ridge_mean)}  # fmt: skip


def default_models(candidates: np.ndarray, parent: np.ndarray) -> list[str]:
    """`--model`'s default: `vanilla/v_48_020` where every candidate is a single mutant, else the four noise
    levels, whose averaged joint score ranks combinations better (docs/campaigns.md)."""
    return NOISE_LEVELS if ((candidates != parent).sum(1) > 1).any() else NOISE_LEVELS[:1]


def model_scores(config: ProposeConfig, models: list[ProteinMPNN], example: dict[str, Any],
                 space: DesignSpace, candidates: np.ndarray, measured: np.ndarray, values: np.ndarray,
                 device: torch.device) -> tuple[np.ndarray, Adapted | None]:  # fmt: skip
    """The model features of the candidates and then the measured variants, ``[C + N, S]``: the zero-shot
    joint score (the mean of ``models``'), and where adapting the first model keeps an adapted one its score
    (one order; of the measured variants cross-fitted: by models that did not train on them, so that the
    ensemble weighs it by what it predicts); and the adaptation, if one ran."""
    # sampled candidates mutate hundreds of position sets: one order each
    orders = 1 if sampled(space, config) else MAX_ORDERS
    everything = np.vstack([candidates, measured.astype(np.uint8)])
    scores = np.mean([zero_shot(m, example, space, everything, device, orders) for m in models], 0)[:, None]
    singles = (measured != space.parent).sum(1).max(initial=0) <= 1
    wanted = config.adapt == "yes" or (config.adapt == "auto" and singles)
    if not (wanted and len(measured) >= AdaptOptions.min_labels and np.ptp(values) > 0):
        return scores, None
    adapted = adapt_to_measurements(models[0], example, space, measured, values, config.seed, device)
    if adapted.decision == "adapted":
        tuned = zero_shot(adapted.model.eval(), example, space, candidates, device, ADAPTED_ORDERS)
        scores = np.hstack([scores, np.r_[tuned, adapted.out_of_fold[0]][:, None]])
    return scores, adapted


def propose_round(config: ProposeConfig, models: list[ProteinMPNN] | None = None) -> dict[str, Any]:
    """Write the campaign's next round (``models``: those `config.model` names, loaded); returns its summary
    (round, counts, where the files are). The models of a first call without `--model` are chosen by its
    candidates (`default_models`) and saved with the round."""
    start = time.time()
    reuse_freed_memory()
    config = settle_campaign(config)
    folder = Path(config.campaign)
    round_0 = folder / "round_0" / "measurements.csv"
    # measurements made before the campaign: copied into round_0 with the first round
    before = read_measurements(config.measurements, config.value_field) if config.measurements else []
    before = [] if round_0.exists() else before
    done = rounds_of(folder)
    last = max([n for n in done if n > 0], default=0)
    if last and not (folder / f"round_{last}" / "measurements.csv").exists():
        raise DataError(
            f"{folder / f'round_{last}'}: its proposals await their measurements: write them to "
            f"{folder / f'round_{last}' / 'measurements.csv'} (mutations,value), then propose again"
        )
    models = models or [as_model(name) for name in config.model or NOISE_LEVELS[:1]]
    options = config.parse_options(models[0].config)
    for name, other in zip((config.model or [])[1:], models[1:], strict=True):
        if config.parse_options(other.config) != options:
            raise ValueError(
                f"--model {config.model[0]} {name}: a LigandMPNN and a ProteinMPNN model read a structure "
                "differently: average models of one kind"
            )
    space, example = read_design_space(config.structure, config.chain_id, config.positions,
                                       config.allowed_aas, config.max_mutations, config.parent,
                                       options)  # fmt: skip
    if config.candidates is None and config.max_mutations > len(space.positions):
        raise ValueError(
            f"--max_mutations {config.max_mutations}: only {len(space.positions)} positions may change; give "
            f"at most {len(space.positions)} or more --positions"
        )
    rows = read_campaign_measurements(folder, config) + before
    measured, values = measured_variants(space, rows)
    values = -values if config.lower_is_better else values
    device = resolve_device(config.device)
    models = [m.to(device).eval() for m in models]
    candidates = candidate_variants(space, config, models[0], example, device)
    if not config.model:  # the campaign's first call, its models chosen by its candidates
        config = replace(config, model=default_models(candidates, space.parent))
        models += [as_model(name).to(device).eval() for name in config.model[1:]]
    if len(measured):
        candidates = candidates[~np.isin(_keys(candidates), _keys(measured.astype(np.uint8)))]
    if config.batch_size > len(candidates):
        raise ValueError(
            f"--batch_size {config.batch_size}: only {len(candidates)} candidates are left unmeasured; "
            "propose fewer or widen the design space"
        )
    scores, adapted = model_scores(config, models, example, space, candidates, measured, values, device)
    candidate_scores, measured_scores = scores[: len(candidates)], scores[len(candidates) :]
    if len(measured) >= MIN_MEASURED and np.ptp(values) > 0:
        draw_seed = config.seed + len(measured)
        ca = example_ca(example, len(space.parent))
        picked, mean, uncertainty = choose_batch(measured, values, measured_scores, candidates,
                                                 candidate_scores, space.parent, config.batch_size,
                                                 config.acquisition, config.members, config.seed, draw_seed,
                                                 ca=ca)  # fmt: skip
        rules = [config.acquisition] * len(picked)
        why = f"{config.acquisition} on the ensemble of {config.members} ({len(measured)} measured"
        why += f"; model {adapted.decision})" if adapted else ")"
    else:
        batch = config.batch_size
        picked, covering = zero_shot_batch(candidates, candidate_scores[:, 0], space.parent, batch)
        mean = uncertainty = np.full(len(candidates), np.nan)
        rules = ["zero_shot_coverage" if c else "zero_shot" for c in covering]
        why = (f"zero-shot joint delta_logp, its best and covering the space's residues "
               f"({len(measured)} measured, fewer than {MIN_MEASURED} to fit on)")  # fmt: skip
    sign = -1.0 if config.lower_is_better else 1.0
    n = last + 1
    out = folder / f"round_{n}"
    table = ["rank,mutations,sequence,predicted,uncertainty,zero_shot_delta_logp,picked_by"]
    fasta = []
    for rank, (i, rule) in enumerate(zip(picked, rules, strict=True), 1):
        sequence = "".join(ALPHABET[t] for t in candidates[i])
        mutations = space.mutations(candidates[i])
        table.append(f"{rank},{mutations},{sequence},{_number(sign * mean[i])},{_number(uncertainty[i])},"
                     f"{candidate_scores[i, 0]:.4f},{rule}")  # fmt: skip
        said = (f"predicted={sign * mean[i]:.4f} uncertainty={uncertainty[i]:.4f}" if np.isfinite(mean[i])
                else f"zero_shot_delta_logp={candidate_scores[i, 0]:.4f}")  # fmt: skip
        fasta.append(f">round{n}_{rank:03d} {mutations} {said}\n{sequence}\n")
    staging = folder / f".round_{n}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    write_text(staging / "proposals.csv", "\n".join(table) + "\n")
    write_text(staging / "proposals.fasta", "".join(fasta))
    if adapted is not None:
        write_json(staging / "adapt.json", adaptation_report(adapted))
        if adapted.decision == "adapted":
            adapted.model.save_pretrained(staging / "model")
    if not (folder / CAMPAIGN_FILE).exists():
        write_json(
            folder / CAMPAIGN_FILE, {name: getattr(config, name) for name in (*DESIGN_FIELDS, *ROUND_FIELDS)}
        )
    if before:
        round_0.parent.mkdir(exist_ok=True)
        shutil.copyfile(config.measurements, round_0)
    staging.replace(out)
    summary = {"round": n, "measured": len(measured), "candidates": len(candidates), "proposed": len(picked),
               "picked_by": why, "proposals": str(out / "proposals.csv"),
               "fasta": str(out / "proposals.fasta"),
               "best_measured": None if not len(values) else float(sign * values.max())}  # fmt: skip
    zero_shot_of = {_key(v): float(score) for v, score in zip(measured, measured_scores[:, 0], strict=True)}
    outcomes = round_outcomes(folder, config, space, zero_shot_of)
    if outcomes:
        summary["last_round"] = outcomes[-1].summary(config.lower_is_better)
        summary["picture"] = picture_or_note(lambda: draw_campaign(folder, config, outcomes))
    return summary | {"seconds": round(time.time() - start, 1)}


def _key(tokens: np.ndarray) -> bytes:
    return tokens.astype(np.int64).tobytes()


def _keys(variants: np.ndarray) -> np.ndarray:
    return np.array([row.tobytes() for row in np.ascontiguousarray(variants)])


def _number(value: float) -> str:
    return "" if not np.isfinite(value) else f"{value:.4f}"


def run_campaign(config: ProposeConfig, models: list[ProteinMPNN] | None = None,
                 reward: RewardFunction | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """`config.rounds` rounds; with a reward (``reward``, ``config.reward`` or ``config.reward_command``)
    each round's proposals are measured by it into `round_N/measurements.csv` before the next, and
    `campaign.png` drawn with the last. Returns the rounds' summaries."""
    measured = reward or config.reward or config.reward_command
    if config.rounds > 1 and not measured:
        raise ValueError(f"--rounds {config.rounds}: give --reward or --reward_command to measure each round")
    summaries = []
    for _ in range(config.rounds):
        summary = propose_round(config, models)
        if measured:
            measure_round(Path(summary["proposals"]), config, reward)
            summary["measured_by"] = (
                getattr(reward, "__name__", None) or config.reward or config.reward_command
            )
        summaries.append(summary)
    if measured:  # the last round's measurements drawn too
        summaries[-1]["picture"] = picture_or_note(lambda: plot_campaign_folder(config.campaign))
    return summaries


def measure_round(proposals: Path, config: ProposeConfig, reward: RewardFunction | None) -> None:
    """The reward of each proposal, written beside it as `measurements.csv` (mutations,value)."""
    settings = json.loads((Path(config.campaign) / CAMPAIGN_FILE).read_text())
    chains = settings["chain_id"] or list(dict.fromkeys(c for c, _ in prepare_design(
        Path(settings["structure"]), [], [], {}).residue_numbers))  # fmt: skip
    rows = list(csv.DictReader(proposals.open()))
    records = [{"pdb_file": settings["structure"], "design_chains": chains, "fixed_chains": [],
                "sequence": row["sequence"]} for row in rows]  # fmt: skip
    values = compute_rewards(records, reward or config.reward, config.reward_command)
    lines = "".join(f"{row['mutations']},{value!r}\n" for row, value in zip(rows, values, strict=True))
    write_text(proposals.parent / "measurements.csv", "mutations,value\n" + lines)


def propose(
    campaign: str | Path,
    model: ProteinMPNN | str | Path | Sequence[ProteinMPNN | str | Path] | None = None,
    reward: RewardFunction | str | None = None,
    **options: Any,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Write the next round of the campaign in folder `campaign`, as `python -m dpo_inv propose` does;
    `model` is its `--model` (a model, name or path, or several whose joint scores are averaged; default
    `default_models`); `options` are the command's others (:class:`ProposeConfig`: `structure`, `chain_id`,
    `positions`, `allowed_aas`, `max_mutations`, `batch_size`, `rounds`, ...), with its defaults. Returns
    the round's summary; its proposals are in `summary["proposals"]`. With a `reward` (a function given the
    proposals as records — `pdb_file`, `design_chains`, `fixed_chains`, `sequence` — and returning one
    number each, or its `file.py:function` name), each round is measured by it before the next, and the
    list of the `rounds` summaries is returned."""
    given = [] if model is None else [model] if isinstance(model, ProteinMPNN | str | Path) else list(model)
    names = [str(m) if isinstance(m, str | Path) else m.config.name_or_path for m in given]
    named = reward if isinstance(reward, str) else None
    chosen = {"model": names} if names else {}
    config = ProposeConfig(campaign=str(campaign), reward=named, **chosen, **options)
    objects = any(isinstance(m, ProteinMPNN) for m in given)
    summaries = run_campaign(config, [as_model(m) for m in given] if objects else None,
                             None if named else reward)  # fmt: skip
    return summaries if reward is not None or config.reward_command else summaries[0]
