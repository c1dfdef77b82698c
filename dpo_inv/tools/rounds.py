"""On-policy rounds of sampling, scoring, pairing and training: `dpo-inv rounds` in Python, and what
`python -m dpo_inv rounds` runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from dpo_inv.data.records import DataError, write_jsonl
from dpo_inv.errors import OptionError
from dpo_inv.models.mpnn import ProteinMPNN, derive_seed
from dpo_inv.models.options import check_signs
from dpo_inv.models.weights import load_model, model_parse_options
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.pairs import PairingOptions, PairsConfig, pairs_file
from dpo_inv.tools.reward_fn import RewardError, RewardFunction, RewardOptions, compute_rewards
from dpo_inv.tools.sample import SampleOptions, sample_structure
from dpo_inv.tools.targets import Targets, load_targets
from dpo_inv.training.config import DPOConfig, field_help
from dpo_inv.training.exits import EXIT_BAD_INPUT
from dpo_inv.training.launch import say
from dpo_inv.training.loading import load_data
from dpo_inv.training.output_lock import output_lock
from dpo_inv.training.plot import plot_rounds
from dpo_inv.training.stopping import TrainingStopped, ending
from dpo_inv.training.trainer import fit, load_models, start_job


@dataclass
class RoundsConfig(DPOConfig, RewardOptions, PairingOptions):
    """The training configuration, plus what the rounds sample, how they are scored (the reward, higher =
    better unless reward_lower_is_better) and paired (a target's samples of a round, by reward)."""

    targets_file: str | None = field(
        default=None,
        **field_help(
            "Design targets (JSON lines): pdb_file, chain_id or design_chains/fixed_chains, fixed_positions."
        ),
    )
    num_rounds: int = field(default=2, **field_help("Rounds of sampling, scoring, pairing and training."))
    num_samples: int = field(default=16, **field_help("Sequences sampled per target and round."))
    sampling_temperature: float = field(default=0.2, **field_help("Sampling temperature."))
    sampling_batch_size: int = field(default=16, **field_help("Samples decoded together."))
    omit_aas: str = field(default="", **field_help("Amino acids never sampled, e.g. CM (X never is)."))
    reward_lower_is_better: bool = field(default=False, **field_help("A lower reward is better (an energy)."))
    reference_per_round: Literal["base", "previous"] = field(
        default="base",
        **field_help(
            "The reference of each round: the starting model (base), or the model the round starts from."
        ),
    )
    labels_from_quantile: float = field(
        default=0.5,
        **field_help("kto: a sample is desirable when its reward beats this quantile of its target's."),
    )
    eval_split: float = field(
        default=0.0, **field_help("Fraction of each round's targets held out of training.")
    )
    output_dir: str = field(default="outputs/rounds", **field_help("Where the rounds are written."))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.targets_file is None:
            raise OptionError("targets_file is required: the design targets, one JSON line each")
        check_signs(
            self, positive=("num_rounds", "sampling_batch_size"), non_negative=("sampling_temperature",)
        )
        self.check_pairing()
        if self.strategy == "same_position":
            raise OptionError(
                "strategy same_position pairs single mutants of a wildtype_seq, which a round's samples are "
                "not: give best_vs_worst, all or top_vs_rest"
            )
        self.check_reward()
        if self.num_samples < 2:
            raise OptionError("num_samples must be at least 2: pairs need two samples of a target")
        if not 0 <= self.labels_from_quantile < 1:
            raise OptionError(f"labels_from_quantile must be in [0, 1), got {self.labels_from_quantile}")


@dataclass
class Pass:
    """One sampling pass: its samples (with their rewards once scored), where they are written, since when."""

    round: int
    directory: Path
    samples: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def samples_file(self) -> Path:
        return self.directory / "samples.jsonl"


def round_dir(config: RoundsConfig, k: int) -> Path:
    return Path(config.output_dir) / f"round-{k}"


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def stop_everywhere(accelerator: Accelerator, message: str | None, exit_code: int = EXIT_BAD_INPUT) -> None:
    """Collective: when rank 0 has a message, every rank stops with it."""
    (message,) = broadcast_object_list([message])
    if message is not None:
        raise TrainingStopped(message, exit_code)


def sample_targets(
    accelerator: Accelerator, policy: ProteinMPNN, targets: Targets, config: RoundsConfig, k: int
) -> list[dict]:
    """Every target's samples from `policy`, each rank sampling its share of the targets; seeded by (seed,
    round, target), so they do not depend on the number of processes. The same list on every rank."""
    policy.to(accelerator.device).eval()
    mine = []
    for index in range(accelerator.process_index, len(targets), accelerator.num_processes):
        design = targets.designs[index]
        options = SampleOptions(
            fixed_chains=targets.fixed_chains[index],
            num_samples=config.num_samples,
            temperature=config.sampling_temperature,
            omit_aas=config.omit_aas,
            batch_size=config.sampling_batch_size,
            seed=derive_seed(config.seed, k, index),
        )
        with torch.no_grad():
            for sample in sample_structure(policy, design, options, bias=torch.zeros(len(ALPHABET))):
                mine.append({"round": k, "target": index, "pdb_file": sample.pop("structure"), **sample})
    gathered = gather_object(mine) if accelerator.num_processes > 1 else mine
    return sorted(gathered, key=lambda r: (r["target"], r["sample"]))


def score_samples(
    accelerator: Accelerator, config: RoundsConfig, sampled: Pass, reward: RewardFunction | None
) -> None:
    """Rank 0 saves the samples, computes their rewards, and saves them again with the rewards. A reward
    that fails stops every rank, rank 0 naming the round and the record; the samples stay saved."""
    failure = None
    if accelerator.is_main_process:
        write_jsonl(sampled.samples_file, sampled.samples)
        try:
            rewards = compute_rewards(sampled.samples, reward or config.reward, config.reward_command)
            for sample, reward in zip(sampled.samples, rewards, strict=True):
                sample["reward"] = reward
            write_jsonl(sampled.samples_file, sampled.samples)
        except RewardError as err:
            failure = (
                f"round {sampled.round}: {err}. The samples are saved in {sampled.samples_file}; once the "
                f"reward is fixed, run again with --resume_from_checkpoint latest"
            )
    stop_everywhere(accelerator, failure)
    (rewards,) = broadcast_object_list([[s.get("reward") for s in sampled.samples]])
    for sample, reward in zip(sampled.samples, rewards, strict=True):
        sample["reward"] = reward


def sampling_pass(
    accelerator: Accelerator,
    config: RoundsConfig,
    policy: ProteinMPNN,
    targets: Targets,
    k: int,
    reward: RewardFunction | None,
) -> Pass:
    """Round k's samples with their rewards: those an interrupted run saved, else new ones."""
    sampled = Pass(k, round_dir(config, k))
    sampled.samples = read_jsonl(sampled.samples_file)
    if sampled.samples:
        say(accelerator, f"Round {k}: {len(sampled.samples)} samples read from {sampled.samples_file}")
    else:
        sampled.samples = sample_targets(accelerator, policy, targets, config, k)
    if any("reward" not in s for s in sampled.samples):
        score_samples(accelerator, config, sampled, reward)
    return sampled


def training_file(accelerator: Accelerator, config: RoundsConfig, sampled: Pass) -> tuple[Path, int]:
    """Rank 0 writes the round's pairs (labelled samples for kto) with `dpo-inv pairs`; returns the file
    and its number of records."""
    output = sampled.directory / ("labels.jsonl" if config.unpaired else "pairs.jsonl")
    failure, count = None, 0
    if accelerator.is_main_process:
        options = PairsConfig(
            model=config.model_name_or_path,
            output=str(output),
            data=str(sampled.samples_file),
            score_field="reward",
            lower_is_better=config.reward_lower_is_better,
            strategy=config.strategy,
            min_margin=config.min_margin,
            top_k=config.top_k,
            max_pairs_per_structure=config.max_pairs_per_structure,
            labels_from_quantile=config.labels_from_quantile if config.unpaired else None,
            seed=config.seed,
            cache_dir=config.cache_dir,
        )
        try:
            count = pairs_file(options)["sequences" if config.unpaired else "pairs"]
        except DataError as err:
            failure = f"round {sampled.round}: {err}"
    stop_everywhere(accelerator, failure)
    (count,) = broadcast_object_list([count])
    return output, count


def diversity(samples: list[dict]) -> float:
    """Mean pairwise sequence identity of the samples of each target, averaged over the targets."""
    by_target: dict[int, list[str]] = {}
    for sample in samples:
        by_target.setdefault(sample["target"], []).append(sample["sequence"])
    identities = []
    for sequences in by_target.values():
        tokens = np.array([np.frombuffer(s.encode(), dtype=np.uint8) for s in sequences])
        same = (tokens[:, None] == tokens[None]).mean(-1)
        identities.append(same[np.triu_indices(len(sequences), k=1)].mean())
    return float(np.mean(identities))


def summary(sampled: Pass, num_records: int | None, train_steps: int) -> dict:
    """The line of rounds.jsonl for a sampling pass."""
    rewards = np.array([s["reward"] for s in sampled.samples])
    return {
        "round": sampled.round,
        "mean_reward": round(float(rewards.mean()), 4),
        "median_reward": round(float(np.median(rewards)), 4),
        "best_reward": round(float(rewards.max()), 4) + 0.0,  # no -0.0
        "num_samples": len(rewards),
        "num_pairs": num_records,
        "recovery": round(float(np.mean([s["recovery"] for s in sampled.samples])), 4),
        "diversity": round(diversity(sampled.samples), 4),
        "train_steps": train_steps,
        "seconds": round(time.perf_counter() - sampled.started, 1),
    }


def record(accelerator: Accelerator, config: RoundsConfig, line: dict) -> None:
    """Rank 0 appends a pass's line to rounds.jsonl; it is said, and the trackers get it."""
    if accelerator.is_main_process:
        with open(Path(config.output_dir) / "rounds.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")
    records = f", {line['num_pairs']} training records" if line["num_pairs"] is not None else ""
    say(
        accelerator,
        f"Round {line['round']}: mean reward {line['mean_reward']:.4f} (median {line['median_reward']:.4f}, "
        f"best {line['best_reward']:.4f}), recovery {line['recovery']:.3f}, diversity "
        f"{line['diversity']:.3f}{records}",
    )
    tracked = ("mean_reward", "median_reward", "best_reward", "recovery", "diversity")
    accelerator.log({f"rounds/{name}": line[name] for name in tracked}, step=line["round"])


def prepare_output(accelerator: Accelerator, config: RoundsConfig) -> list[dict]:
    """The lines of the rounds finished before (a model round-K/final and its line), with
    resume_from_checkpoint; rounds.jsonl is rewritten to hold just them. A new run refuses to write over
    another's rounds."""
    output_dir = Path(config.output_dir)
    lines = read_jsonl(output_dir / "rounds.jsonl")
    if (lines or any(output_dir.glob("round-*/samples.jsonl"))) and not config.resume_from_checkpoint:
        raise DataError(
            f"{output_dir} holds the rounds of another run: pass --resume_from_checkpoint latest to continue "
            "them, or choose another output_dir"
        )
    done = 0
    while done < min(len(lines), config.num_rounds) and (round_dir(config, done) / "final").is_dir():
        done += 1
    accelerator.wait_for_everyone()  # every rank has read the old file
    if accelerator.is_main_process:
        write_jsonl(output_dir / "rounds.jsonl", lines[:done])
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    accelerator.wait_for_everyone()
    return lines[:done]


def round_reference(accelerator: Accelerator, config: RoundsConfig, base: torch.nn.Module | None, k: int):
    """The reference of round k: the starting model's, or (reference_per_round: previous) the model the
    round starts from, frozen."""
    if config.reference_per_round == "base" or k == 0 or base is None:
        return base
    reference = load_model(round_dir(config, k - 1) / "final", augment_eps=0.0)
    return reference.to(accelerator.device).eval().requires_grad_(False)


def rounds(config: RoundsConfig, reward: RewardFunction | None = None) -> list[dict]:
    """On-policy rounds as `python -m dpo_inv rounds` runs them: each round samples from the current model,
    scores the samples, pairs them and trains on them; a last sampling pass scores the final model.

    `reward` is a Python function (one defined in a notebook will do) called with a list of records
    (`pdb_file`, `design_chains`, `fixed_chains`, `sequence`) and returning one number per record, higher
    is better; without it, `config.reward` or `config.reward_command` names the reward. Everything is
    written under `config.output_dir` (round-K/final is the model after round K). Returns the lines of
    rounds.jsonl: one per sampling pass, with its rewards, recovery and diversity. Started by a launcher,
    every process runs it.
    """
    config.check_reward(reward, required=True)
    accelerator, setup = start_job(config)
    with output_lock(accelerator, config.output_dir):
        run_rounds(accelerator, setup, config, reward)
    if accelerator.is_main_process and importlib.util.find_spec("matplotlib") is not None:
        plot_rounds(config.output_dir)
    return read_jsonl(Path(config.output_dir) / "rounds.jsonl")


def run_rounds(
    accelerator: Accelerator, setup: str, config: RoundsConfig, reward: RewardFunction | None
) -> None:
    """The rounds, each trained in round-K (resumed after the last round finished before), and the last
    sampling pass."""
    options = model_parse_options(
        config.model_name_or_path, config.ref_model_name_or_path, config.ligand_context, config.ligand_exclude
    )
    targets = load_targets(config.targets_file, options)
    finished = prepare_output(accelerator, config)
    start = len(finished)
    resumed = round_dir(config, start - 1) / "final" if start else None
    policy, base = load_models(config, accelerator.device, resumed)
    if start:
        say(accelerator, f"Resuming after round {start - 1}, from {resumed}")
    say(
        accelerator,
        f"{len(targets)} targets, {config.num_samples} samples each; rounds {start} to "
        f"{config.num_rounds - 1} of {config.num_rounds}, then a last sampling pass",
    )
    accelerator.init_trackers(config.run_name, config=config.to_sanitized_dict())
    offset = sum(line["train_steps"] for line in finished)
    with ending(accelerator):
        for k in range(start, config.num_rounds):
            sampled = sampling_pass(accelerator, config, policy, targets, k, reward)
            train_file, num_records = training_file(accelerator, config, sampled)
            round_config = dataclasses.replace(
                config,
                train_file=str(train_file),
                output_dir=str(sampled.directory),
                resume_from_checkpoint="latest" if k == start and config.resume_from_checkpoint else None,
            )
            data = load_data(accelerator, round_config)
            reference = round_reference(accelerator, config, base, k)
            fitted = fit(accelerator, round_config, policy, reference, data, setup, offset)
            policy, offset = fitted.model, offset + fitted.steps
            record(accelerator, config, summary(sampled, num_records, fitted.steps))
        last = sampling_pass(accelerator, config, policy, targets, config.num_rounds, reward)
        record(accelerator, config, summary(last, None, 0))
