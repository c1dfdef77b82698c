"""`propose`: write a campaign's next round from what has been measured so far.

Each call reads the campaign folder (`dpo_inv.campaign.folder`), every round's measurements
(`dpo_inv.campaign.history`), scores the candidates with the models (`dpo_inv.campaign.scoring`), asks the
round function for the next batch (`dpo_inv.campaign.round`), and writes it (`dpo_inv.campaign.proposals`),
with `best.csv`, the round's `summary.json` and the picture.
"""

from __future__ import annotations

import csv
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpo_inv.campaign.config import DESIGN_FIELDS, NOISE_LEVELS, ROUND_FIELDS, ProposeConfig
from dpo_inv.campaign.folder import CampaignFolder, MeasuredRound
from dpo_inv.campaign.history import History, read_history, variant_tokens
from dpo_inv.campaign.plot import RoundOutcome, plot_campaign
from dpo_inv.campaign.proposals import round_outcome, write_proposals
from dpo_inv.campaign.round import Batch, CampaignState, RoundSettings, next_batch
from dpo_inv.campaign.scoring import ModelScorer, example_ca, sampled, sampled_variants
from dpo_inv.data.design import DesignSpace, prepare_design, read_design_space, variant_key, variant_keys
from dpo_inv.data.measurements import read_variants
from dpo_inv.data.records import DataError, write_text
from dpo_inv.errors import MeasurementError, OptionError
from dpo_inv.models.combinations import MAX_ORDERS
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.weights import as_model
from dpo_inv.tools.reward_fn import RewardFunction, compute_rewards
from dpo_inv.training.launch import resolve_device, return_freed_memory, reuse_freed_memory


def settle_campaign(config: ProposeConfig) -> ProposeConfig:
    """The campaign's settings: those given to the first call (saved with its round), then those saved; a
    design option given again with another value is bad input."""
    folder = CampaignFolder(Path(config.campaign))
    defaults = ProposeConfig(campaign=config.campaign)
    saved = folder.settings()
    if saved is None:
        if config.structure is None:
            raise OptionError(f"{folder.path}: no campaign.json there: start the campaign with --structure")
        first = {name: getattr(config, name) for name in (*DESIGN_FIELDS, *ROUND_FIELDS)}
        for name in ("structure", "candidates"):
            if first[name] is not None:
                first[name] = str(Path(first[name]).resolve())
        if first["model"]:
            first["model"] = resolved(first["model"])
        return ProposeConfig(**{**asdict(config), **first})
    saved = {name: getattr(defaults, name) for name in DESIGN_FIELDS} | saved
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
            raise OptionError(
                f"{folder.settings_file}: the campaign was started with {name} = {saved[name]!r}, not "
                f"{getattr(config, name)!r}: keep the campaign's settings, or start another campaign folder"
            )
    return ProposeConfig(**{**asdict(config), **saved})


def resolved(models: list[str]) -> list[str]:
    """Model names as given, paths that exist made absolute (a campaign is read from any directory)."""
    return [str(Path(m).resolve()) if Path(m).exists() else m for m in models]


def default_models(candidates: np.ndarray, parent: np.ndarray) -> list[str]:
    """`--model`'s default: `vanilla/v_48_020` where every candidate is a single mutant, else the four noise
    levels, whose averaged joint score ranks combinations better (docs/campaigns.md)."""
    return NOISE_LEVELS if ((candidates != parent).sum(1) > 1).any() else NOISE_LEVELS[:1]


def load_models(config: ProposeConfig, models: list[ProteinMPNN] | None) -> list[ProteinMPNN]:
    """The models `config.model` names (``models``: loaded already), all of one kind."""
    models = models or [as_model(name) for name in config.model or NOISE_LEVELS[:1]]
    options = config.parse_options(models[0].config)
    for name, other in zip((config.model or [])[1:], models[1:], strict=False):
        if config.parse_options(other.config) != options:
            raise OptionError(
                f"--model {config.model[0]} {name}: a LigandMPNN and a ProteinMPNN model read a structure "
                "differently: average models of one kind"
            )
    return models


def candidate_variants(space: DesignSpace, config: ProposeConfig, scorer: ModelScorer) -> np.ndarray:
    """The variants a round chooses from (tokens as bytes): the candidates file's, every variant of the
    space, or, where the space holds more than `MAX_CANDIDATES`, variants drawn from the model."""
    if config.candidates is not None:
        variants = [variant_tokens(space, row) for row in read_variants(config.candidates)]
        return np.unique(np.array(variants, dtype=np.uint8).reshape(-1, len(space.parent)), axis=0)
    if sampled(space, config.candidates):
        return sampled_variants(scorer.models[0], scorer.example, space, config.seed, scorer.device).astype(
            np.uint8
        )
    return space.enumerate()


def included_variants(space: DesignSpace, config: ProposeConfig, history: History,
                      candidates: np.ndarray) -> np.ndarray | None:  # fmt: skip
    """The variants of `--include`: each in the space (a listed space: among its candidates) and not measured
    (one that failed may be measured again), at most `--num_proposals` of them, else bad input."""
    if config.include is None:
        return None
    listed = set(variant_keys(candidates)) if config.candidates is not None else None
    done = set(variant_keys(history.measured))
    variants = []
    for row in read_variants(config.include):
        tokens = variant_tokens(space, row)
        key = variant_key(tokens)
        if key in done:
            raise DataError(f"{row.location}: {row.variant or 'the parent'} is measured already: include "
                            "variants not yet measured")  # fmt: skip
        inside = (
            space.contains(tokens) and (tokens != space.parent).any() if listed is None else key in listed
        )
        if not inside:
            raise DataError(f"{row.location}: {row.variant or 'the parent'} is outside the campaign's "
                            "design space (its positions, amino acids, number of mutations): include its "
                            "variants")  # fmt: skip
        variants.append(tokens)
    included = np.unique(np.array(variants, dtype=np.uint8).reshape(-1, len(space.parent)), axis=0)
    if len(included) > config.num_proposals:
        raise OptionError(f"--include {config.include}: {len(included)} variants, more than --num_proposals "
                          f"{config.num_proposals}: include fewer or propose more")  # fmt: skip
    return included


def propose_round(config: ProposeConfig, models: list[ProteinMPNN] | None = None) -> dict[str, Any]:
    """Write the campaign's next round (``models``: those `config.model` names, loaded); returns its summary
    (round, counts, where the files are). The models of a first call without `--model` are chosen by its
    candidates (`default_models`) and saved with the round."""
    start = time.time()
    reuse_freed_memory()
    config = settle_campaign(config)
    folder = CampaignFolder(Path(config.campaign))
    with folder.lock():
        folder.check_measured()
        models = load_models(config, models)
        options = config.parse_options(models[0].config)
        space, example = read_design_space(config.structure, config.chain_id, config.positions,
                                           config.allowed_aas, config.max_mutations, config.parent,
                                           options)  # fmt: skip
        if config.candidates is None and config.max_mutations > len(space.positions):
            raise OptionError(
                f"--max_mutations {config.max_mutations}: only {len(space.positions)} positions may change; "
                f"give at most {len(space.positions)} or more --positions"
            )
        measured = folder.measured_rounds(config.score_field, config.measurements)
        history = read_history(space, measured, listed=config.candidates is not None)
        device = resolve_device(config.device)
        models = [m.to(device).eval() for m in models]
        orders = 1 if sampled(space, config.candidates) else MAX_ORDERS
        scorer = ModelScorer(models, example, space, device, orders)
        candidates = candidate_variants(space, config, scorer)
        if not config.model:  # the campaign's first call, its models chosen by its candidates
            config = replace(config, model=default_models(candidates, space.parent))
            scorer.models += [as_model(name).to(device).eval() for name in config.model[1:]]
        sign = -1.0 if config.lower_is_better else 1.0
        state = CampaignState(space.parent, candidates, history.measured, sign * history.values,
                              history.failed, example_ca(example, len(space.parent)),
                              included_variants(space, config, history, candidates))  # fmt: skip
        settings = RoundSettings(config.num_proposals, config.acquisition, config.members, config.adapt,
                                 config.seed)  # fmt: skip
        fingerprint = scorer.fingerprint()
        scorer.known.update(folder.read_zero_shot(fingerprint, space.parent))
        kept = len(scorer.known)
        batch = next_batch(state, scorer, settings)
        for line in history.warnings:
            print(f"propose: warning: {line}", file=sys.stderr, flush=True)
        n = folder.last_proposed() + 1
        write_proposals(folder.stage(n), n, space, batch, config.lower_is_better)
        saved = {name: getattr(config, name) for name in (*DESIGN_FIELDS, *ROUND_FIELDS)}
        out = folder.commit(n, saved, config.measurements)
        if len(scorer.known) > kept:
            folder.keep_zero_shot(fingerprint, space.parent, scorer.known)
        summary = round_summary(folder, config, space, measured, history, batch, n, out)
        folder.write_best(history.best(space, config.lower_is_better))
        summary["best_file"] = str(folder.best_file)
        summary["seconds"] = round(time.time() - start, 1)
        folder.write_summary(n, summary)
    return_freed_memory()
    return summary


def round_summary(folder: CampaignFolder, config: ProposeConfig, space: DesignSpace,
                  measured: list[MeasuredRound], history: History, batch: Batch, n: int,
                  out: Path) -> dict[str, Any]:  # fmt: skip
    """The summary line of round ``n`` (``measured``: the rounds ``history`` was read from), with how the last
    measured round went, and the picture drawn."""
    summary = {"round": n, "measured": len(history.values), "failed": len(history.failed),
               "candidates": batch.candidates, "proposed": len(batch.variants), "picked_by": batch.why,
               "predictor": batch.predictor, "batch": dict(Counter(batch.picked_by)),
               "proposals": str(out / "proposals.csv"), "fasta": str(out / "proposals.fasta"),
               "best_measured": None if not len(history.values) else
               float((min if config.lower_is_better else max)(history.values))}  # fmt: skip
    zero_shot_of = {variant_key(v): float(s)
                    for v, s in zip(history.measured, batch.measured_zero_shot, strict=True)}  # fmt: skip
    outcomes = campaign_outcomes(measured, history, zero_shot_of)
    parent_value = history.value_of(space.parent)
    if outcomes:
        summary["last_round"] = outcomes[-1].summary(config.lower_is_better)
        summary["picture"] = draw_or_note(folder, config, outcomes, parent_value)
    return summary


def campaign_outcomes(measured: list[MeasuredRound], history: History,
                      zero_shot_of: dict[bytes, float] | None = None) -> list[RoundOutcome]:  # fmt: skip
    """Each measured round's values and what was predicted of its measured proposals (``history``: read from
    ``measured``)."""
    pairs = zip(measured, history.keys, strict=True)
    return [round_outcome(m, keys, zero_shot_of or {}) for m, keys in pairs]


def draw(folder: CampaignFolder, config: ProposeConfig, outcomes: list[RoundOutcome],
         parent_value: float | None) -> Path:  # fmt: skip
    """Draw `campaign.png` (matplotlib's ImportError where it is not installed)."""
    title = f"{folder.path.name}: {Path(config.structure or '').name} {config.positions}".strip()
    plot_campaign(folder.picture, outcomes, config.lower_is_better, title, parent_value)
    return folder.picture


def draw_or_note(folder: CampaignFolder, config: ProposeConfig, outcomes: list[RoundOutcome],
                 parent_value: float | None) -> str | None:  # fmt: skip
    """Draw `campaign.png`: its path, or None with a note on stderr where matplotlib is not installed."""
    try:
        return str(draw(folder, config, outcomes, parent_value))
    except ImportError:
        print("propose: campaign.png needs matplotlib: pip install matplotlib", file=sys.stderr)
        return None


@dataclass(frozen=True)
class Campaign:
    """A campaign folder read back: its settings, design space and everything measured in it."""

    config: ProposeConfig
    space: DesignSpace
    folder: CampaignFolder
    measured: list[MeasuredRound]
    history: History


def read_campaign(path: str | Path) -> Campaign:
    """The campaign in folder ``path``, as its `campaign.json` and rounds hold it."""
    config = settle_campaign(ProposeConfig(campaign=str(path)))
    space, _ = read_design_space(config.structure, config.chain_id, config.positions, config.allowed_aas,
                                 config.max_mutations, config.parent)  # fmt: skip
    folder = CampaignFolder(Path(path))
    measured = folder.measured_rounds(config.score_field)
    return Campaign(config, space, folder, measured,
                    read_history(space, measured, listed=config.candidates is not None))  # fmt: skip


def plot_campaign_folder(path: str | Path) -> Path:
    """Draw `campaign.png` of the campaign in ``path`` (what `python -m dpo_inv plot DIR` does there); a
    campaign with nothing measured yet is bad input."""
    campaign = read_campaign(path)
    outcomes = campaign_outcomes(campaign.measured, campaign.history)
    if not outcomes:
        raise MeasurementError(
            f"{campaign.folder.path}: nothing measured yet, nothing to draw: write a round's measurements "
            "(round_N/measurements.csv), then plot"
        )
    return draw(campaign.folder, campaign.config, outcomes, campaign.history.value_of(campaign.space.parent))


def run_campaign(config: ProposeConfig, models: list[ProteinMPNN] | None = None,
                 reward: RewardFunction | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """`config.rounds` rounds; with a reward (``reward``, ``config.reward`` or ``config.reward_command``)
    each round's proposals are measured by it into `round_N/measurements.csv` before the next, and
    `campaign.png` drawn with the last. Returns the rounds' summaries."""
    measured = config.check_reward(reward)
    if config.rounds > 1 and not measured:
        raise OptionError(
            f"--rounds {config.rounds}: give --reward or --reward_command to measure each round"
        )
    folder = CampaignFolder(Path(config.campaign))
    summaries = []
    for _ in range(config.rounds):
        summary = propose_round(config, models)
        if measured:
            measure_round(Path(summary["proposals"]), config, reward)
            summary["measured_by"] = (
                getattr(reward, "__name__", None) or config.reward or config.reward_command
            )
            folder.write_summary(summary["round"], summary)
        summaries.append(summary)
    if measured:  # the last round's measurements in best.csv and drawn too
        done = read_campaign(config.campaign)
        folder.write_best(done.history.best(done.space, done.config.lower_is_better))
        outcomes = campaign_outcomes(done.measured, done.history)
        parent_value = done.history.value_of(done.space.parent)
        summaries[-1]["picture"] = draw_or_note(folder, done.config, outcomes, parent_value)
        folder.write_summary(summaries[-1]["round"], summaries[-1])
    return summaries


def measure_round(proposals: Path, config: ProposeConfig, reward: RewardFunction | None) -> None:
    """The reward of each proposal, written beside it as `measurements.csv` (mutations,value)."""
    settings = settle_campaign(ProposeConfig(campaign=config.campaign))
    structure = Path(settings.structure)
    chains = settings.chain_id or prepare_design(structure, [], [], {}).design_chains
    rows = list(csv.DictReader(proposals.open()))
    records = [{"pdb_file": str(structure), "design_chains": chains, "fixed_chains": [],
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
    `positions`, `allowed_aas`, `max_mutations`, `num_proposals`, `rounds`, ...), with its defaults. Returns
    the round's summary; its proposals are in `summary["proposals"]`. With a `reward` (a function given the
    proposals as records — `pdb_file`, `design_chains`, `fixed_chains`, `sequence` — and returning one
    number each, or its `file.py:function` name), each round is measured by it before the next, and the
    list of the `rounds` summaries is returned."""
    single = isinstance(model, torch.nn.Module | str | Path)
    given = [] if model is None else [model] if single else list(model)
    names = [str(m) if isinstance(m, str | Path) else m.config.name_or_path for m in given]
    named = reward if isinstance(reward, str) else None
    chosen = {"model": names} if names else {}
    config = ProposeConfig(campaign=str(campaign), reward=named, **chosen, **options)
    objects = any(isinstance(m, torch.nn.Module) for m in given)
    summaries = run_campaign(config, [as_model(m) for m in given] if objects else None,
                             None if named else reward)  # fmt: skip
    return summaries if reward is not None or config.reward_command else summaries[0]
