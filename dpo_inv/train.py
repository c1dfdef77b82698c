"""The DPO training loop: one Accelerator, read top to bottom."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import datasets
import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, TorchDynamoPlugin, broadcast_object_list, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from dpo_inv.config import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NONFINITE, DPOConfig
from dpo_inv.data import (
    REFERENCE_COLUMNS,
    DataError,
    LengthGroupedSampler,
    PairDataset,
    PreferenceDataset,
    collate,
    load_pairs,
    load_saved_pairs,
)
from dpo_inv.launch import device_backend, setup_environment
from dpo_inv.loss import PairLogps, batch_ranks, example_seeds, pair_logps, preference_loss
from dpo_inv.model import ProteinMPNN, load_model
from dpo_inv.plot import plot
from dpo_inv.sample import sample_sequences

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
STATE_FILE = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"step-(\d+)")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what PBS and SLURM send before the walltime


class TrainingStopped(Exception):
    """Training ended early and rank 0 has said why; `exit_code` is the exit status to report."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainerState:
    """Where training stands; saved in every checkpoint beside Accelerate's state."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    best_eval_loss: float = math.inf

    def save(self, directory: Path) -> None:
        """Written last, with the size of every file of the checkpoint: a damaged checkpoint is recognised."""
        files = {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}
        (directory / STATE_FILE).write_text(json.dumps({**asdict(self), "files": files}, indent=2))

    @classmethod
    def load(cls, directory: Path) -> TrainerState:
        fields = json.loads((directory / STATE_FILE).read_text())
        del fields["files"]
        return cls(**fields)


class StopSignals:
    """While entered, SIGTERM or SIGUSR1 asks every rank to stop at the next optimizer step; a second signal
    ends the process at once (the default action). Handlers are installed from the main thread only."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.received = False
        self.previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_DFL)
        self.received = True
        os.write(  # not print: the signal may have interrupted one
            2,
            f"rank {self.accelerator.process_index}: received {signal.Signals(signum).name}, stopping after "
            "this optimizer step with a checkpoint (a second signal ends the process at once)\n".encode(),
        )

    def received_on_any_rank(self) -> bool:
        """Collective, called by every rank once per optimizer step: has any rank received a signal?"""
        if self.received:
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()


def split_by_structure(data: PairDataset, fraction: float, seed: int) -> tuple[PairDataset, PairDataset]:
    """Hold out a seeded fraction of the structures with all their pairs (no structure in both splits)."""
    structure_ids = np.asarray(data.pairs["structure_id"])
    unique = np.unique(structure_ids)
    num_eval = max(1, round(fraction * len(unique)))
    if num_eval >= len(unique):
        raise DataError(
            f"{data.source}: eval_split={fraction} leaves no training structure out of {len(unique)}; lower "
            "eval_split or give an eval_file"
        )
    held_out = np.random.default_rng(seed).choice(unique, size=num_eval, replace=False)
    is_eval = np.isin(structure_ids, held_out)
    train = PairDataset(data.pairs.select(np.flatnonzero(~is_eval)), data.structures, data.source)
    evaluation = PairDataset(data.pairs.select(np.flatnonzero(is_eval)), data.structures, data.source)
    return train, evaluation


def load_data(accelerator: Accelerator, config: DPOConfig) -> tuple[PairDataset, PairDataset | None]:
    """Rank 0 validates the data files and parses their structures into the Arrow cache, before training;
    the other ranks then read its result from there. Bad input stops every rank, rank 0 reporting it."""
    names = [config.train_file, *([config.eval_file] if config.eval_file else [])]
    options = {"structure_roots": config.structure_root or (), "on_bad_record": config.on_bad_record}
    loaded: list[PairDataset] = []
    failure: Exception | None = None
    if accelerator.is_main_process:
        try:
            loaded = validate(config, names, options)
            splits = train_and_eval(config, loaded)  # an impossible eval_split fails here, on rank 0 alone
        except Exception as err:  # raised below, once the other ranks know
            failure = err
    outcome: list | int = [data.files for data in loaded]  # the cache folders of the validated data,
    if failure is not None:  # or the exit status of the other ranks
        outcome = EXIT_BAD_INPUT if isinstance(failure, DataError) else 1
    (outcome,) = broadcast_object_list([outcome])
    if failure is not None:
        raise failure
    if isinstance(outcome, int):
        raise TrainingStopped("rank 0 could not load the data", outcome)
    if accelerator.is_main_process:
        write_skipped(accelerator, config, loaded)
        return splits
    saved = [load_saved_pairs(files, name) for files, name in zip(outcome, names, strict=True)]
    return train_and_eval(config, saved)


def validate(config: DPOConfig, names: list[str], options: dict) -> list[PairDataset]:
    """Load and check every data file; one `DataError` reports the bad records of all of them."""
    loaded, errors = [], []
    for name in names:
        try:
            loaded.append(load_pairs(name, config.cache_dir, config.dataset_num_proc, **options))
        except DataError as err:
            errors.append(str(err))
    if errors:
        raise DataError("\n".join(errors))
    return loaded


def train_and_eval(config: DPOConfig, loaded: list[PairDataset]) -> tuple[PairDataset, PairDataset | None]:
    """The training and eval data: the two files, or eval_split held out of the one."""
    if len(loaded) == 2:
        return loaded[0], loaded[1]
    if config.eval_split > 0:
        return split_by_structure(loaded[0], config.eval_split, config.seed)
    return loaded[0], None


def write_skipped(accelerator: Accelerator, config: DPOConfig, loaded: list[PairDataset]) -> None:
    """With on_bad_record=skip: list the records left out, with their reasons, in skipped.jsonl."""
    skipped = [record for data in loaded for record in data.skipped]
    if not skipped:
        return
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "skipped.jsonl", "w") as handle:
        for record in skipped:
            handle.write(json.dumps(asdict(record), default=str) + "\n")
    accelerator.print(
        f"Skipped {len(skipped)} bad record(s) of {', '.join(data.source for data in loaded)}; each is "
        f"listed with its reason in {output_dir / 'skipped.jsonl'}"
    )


@torch.no_grad()
def precompute_reference(
    accelerator: Accelerator, reference: ProteinMPNN, data: PairDataset, config: DPOConfig
) -> PairDataset:
    """Score every pair with the reference once (sharded over ranks, gathered) and store the log-probs."""
    loader = accelerator.prepare(
        DataLoader(PreferenceDataset(data), batch_size=config.per_device_eval_batch_size, collate_fn=collate)
    )
    chosen, rejected = [], []
    for batch in tqdm(loader, desc="Reference log-probs", disable=not accelerator.is_main_process):
        logps = pair_logps(
            reference,
            batch,
            batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order),
        )
        gathered = accelerator.gather_for_metrics(torch.stack([logps.chosen, logps.rejected], dim=-1))
        chosen.append(gathered[:, 0].cpu())
        rejected.append(gathered[:, 1].cpu())
    pairs = data.pairs
    for name, values in zip(REFERENCE_COLUMNS, (chosen, rejected), strict=True):
        pairs = pairs.add_column(name, torch.cat(values).tolist())
    return PairDataset(pairs, data.structures, data.source)


def reference_logps(
    config: DPOConfig, reference: ProteinMPNN | None, batch: dict[str, torch.Tensor], ranks: torch.Tensor
) -> PairLogps | None:
    if config.reference_free:
        return None
    if config.precompute_ref_log_probs:
        return PairLogps(batch["ref_chosen_logps"], batch["ref_rejected_logps"], batch["loss_mask"].sum(-1))
    with torch.no_grad():
        return pair_logps(reference, batch, ranks)


def step_metrics(config, model, reference, batch, epoch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss of a batch (what is back-propagated) and per-pair metrics [B, len(METRICS)]."""
    ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
    policy = pair_logps(model, batch, ranks)
    losses, out = preference_loss(
        policy,
        reference_logps(config, reference, batch, ranks),
        batch["weight"],
        beta=config.beta,
        loss_types=config.loss_type,
        loss_weights=config.loss_weights or [1.0] * len(config.loss_type),
        label_smoothing=config.label_smoothing,
        rpo_alpha=config.rpo_alpha,
    )
    per_pair = torch.stack(
        [
            losses.detach(),
            out.chosen_rewards,
            out.rejected_rewards,
            (out.chosen_rewards > out.rejected_rewards).float(),
            out.chosen_rewards - out.rejected_rewards,
            policy.chosen.detach(),
            policy.rejected.detach(),
        ],
        dim=-1,
    )
    return losses.mean(), per_pair


@torch.no_grad()
def evaluate(accelerator, config, model, reference, loader, structures) -> dict[str, float]:
    """Metrics over the whole eval set, every pair counted once across ranks, and the native sequence
    recovery of greedy decoding on the eval structures (`structures`: this rank's share, one batch)."""
    model.eval()
    totals, count = torch.zeros(len(METRICS), dtype=torch.float64), 0
    for batch in loader:
        _, per_pair = step_metrics(config, model, reference, batch, epoch=0)
        gathered = accelerator.gather_for_metrics(per_pair).double().cpu()
        totals += gathered.sum(0)
        count += len(gathered)
    recovered = torch.zeros(2, device=accelerator.device)  # recovered, designed residues
    if structures is not None:
        batch = {k: v.to(accelerator.device) for k, v in structures.items()}
        seeds = example_seeds(config.seed, batch["index"], epoch=0)
        tokens = sample_sequences(
            accelerator.unwrap_model(model, keep_torch_compile=False), batch, 1, 0.0, seeds
        ).tokens[:, 0]
        designed = (batch["decode_mask"] * batch["mask"]) > 0
        recovered += torch.stack([((tokens == batch["native"]) & designed).sum(), designed.sum()]).float()
    recovered = accelerator.reduce(recovered, "sum")
    model.train()
    metrics = {f"eval_{name}": float(value) for name, value in zip(METRICS, totals / count, strict=True)}
    return {**metrics, "eval_recovery": float(recovered[0] / recovered[1])}


def eval_structures(accelerator: Accelerator, data: PairDataset) -> dict[str, torch.Tensor] | None:
    """One example per distinct eval structure, this rank's share, as one batch (None if it has none)."""
    _, first = np.unique(np.asarray(data.pairs["structure_id"]), return_index=True)
    dataset = PreferenceDataset(data)
    examples = [
        dataset[int(i)] for i in sorted(first)[accelerator.process_index :: accelerator.num_processes]
    ]
    return collate(examples) if examples else None


def checkpoint_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None: no readable trainer state, or one of its files
    missing or of another size than when it was saved."""
    try:
        files = json.loads((directory / STATE_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"no complete {STATE_FILE} ({err!r})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when saved"
    return None


def find_checkpoint(output_dir: Path, resume_from_checkpoint: str) -> Path | None:
    """A given checkpoint directory, which must be complete, or for `latest` the newest complete one (None
    when the run has not saved any yet, so that a job script can always pass `latest`)."""
    if resume_from_checkpoint != "latest":
        path = Path(resume_from_checkpoint)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise FileNotFoundError(f"{path}: not a complete dpo_inv checkpoint: {problem}")
        return path
    checkpoints = sorted_checkpoints(output_dir)
    if checkpoints:
        return checkpoints[-1]
    if list((output_dir / "checkpoints").glob("step-*")):
        raise FileNotFoundError(
            f"resume_from_checkpoint=latest: no complete checkpoint in {output_dir / 'checkpoints'}, only "
            "damaged ones; give a checkpoint directory, or another output_dir to start anew"
        )
    return None


def sorted_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints by step, oldest first; partial or damaged ones are passed over."""
    found = []
    for path in (output_dir / "checkpoints").glob("step-*"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and checkpoint_problem(path) is None:
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def remove_partial_checkpoints(checkpoints: Path) -> None:
    for partial in checkpoints.glob("*.tmp"):
        shutil.rmtree(partial)


def save_checkpoint(accelerator: Accelerator, config: DPOConfig, state: TrainerState) -> None:
    """Save checkpoints/step-N atomically: every rank writes its part into step-N.tmp, then rank 0 adds the
    trainer state and renames it; the newest `save_total_limit` checkpoints, this one always, are kept."""
    output_dir = Path(config.output_dir)
    checkpoints = output_dir / "checkpoints"
    directory = checkpoints / f"step-{state.global_step}"
    partial = checkpoints / f"{directory.name}.tmp"
    if accelerator.is_main_process:
        remove_partial_checkpoints(checkpoints)  # left by a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.save(partial)
        if directory.exists():  # saved before, e.g. by the run this one resumed: swap, then delete
            directory.rename(checkpoints / f"{directory.name}.old.tmp")
        partial.rename(directory)
        remove_partial_checkpoints(checkpoints)
        if config.save_total_limit is not None:
            others = [p for p in reversed(sorted_checkpoints(output_dir)) if p != directory]  # newest first
            for old in others[config.save_total_limit - 1 :]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()


def save_model(accelerator: Accelerator, model: torch.nn.Module, directory: Path) -> None:
    accelerator.unwrap_model(model, keep_torch_compile=False).save_pretrained(
        directory, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    accelerator.wait_for_everyone()


def check_replicas_agree(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Every rank must hold the same parameters after training; a broken process group shows here."""
    params = [
        p.detach().double().sum()
        for p in accelerator.unwrap_model(model, keep_torch_compile=False).parameters()
    ]
    sums = accelerator.gather(torch.stack(params).unsqueeze(0).to(accelerator.device)).cpu()
    if not torch.equal(sums, sums[:1].expand_as(sums)):
        raise RuntimeError("parameters differ between ranks after training: gradients were not synchronised")
    accelerator.print(f"Parameters identical on all {accelerator.num_processes} process(es)")


def log(accelerator: Accelerator, output_dir: Path, metrics: dict[str, float], step: int) -> None:
    """Rank 0 appends one JSON object to metrics.jsonl and forwards it to the trackers."""
    if accelerator.is_main_process:
        with open(output_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
    accelerator.log(metrics, step=step)


def interrupted(output_dir: Path, step: int, total_steps: int) -> TrainingStopped:
    return TrainingStopped(
        f"Stopped at step {step} of {total_steps} on SIGTERM or SIGUSR1 (the job is near its walltime); "
        f"checkpoint {output_dir / 'checkpoints' / f'step-{step}'}. To finish, run again with "
        f"--output_dir {output_dir} --resume_from_checkpoint latest",
        EXIT_INTERRUPTED,
    )


def diverged(output_dir: Path, step: int, in_a_row: int) -> TrainingStopped:
    return TrainingStopped(
        f"Stopped at step {step}: the loss or the gradient norm was not finite in {in_a_row} optimizer steps "
        f"in a row, which were skipped (the weights are those of step {step - in_a_row}). Usual causes: a "
        "learning rate too high, a beta too large (too small with ipo), fp16 overflow (use bf16 or no mixed "
        f"precision). Checkpoint {output_dir / 'checkpoints' / f'step-{step}'}: after changing the "
        f"configuration, continue with --output_dir {output_dir} --resume_from_checkpoint latest (a resumed "
        "run keeps its learning-rate schedule; to lower the learning rate, start a new run)",
        EXIT_NONFINITE,
    )


def build_accelerator(config: DPOConfig, **options: Any) -> tuple[Accelerator, str]:
    """The Accelerator for the launch environment (process group, backend, precision, compilation) and a
    description of the set-up; `options` go to the Accelerator (trackers, project folder)."""
    launch = setup_environment()
    device_type, backend = device_backend(config.backend) if launch.world_size > 1 else (None, None)
    try:
        accelerator = Accelerator(
            cpu=device_type == "cpu",
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            mixed_precision=config.mixed_precision,
            dynamo_plugin=TorchDynamoPlugin(
                backend=config.torch_compile_backend if config.torch_compile else "no",
                mode=config.torch_compile_mode,
                dynamic=True,  # batch size and length vary from batch to batch
                use_regional_compilation=True,  # compile one encoder and one decoder layer, reuse them
            ),
            kwargs_handlers=[
                InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=config.ddp_timeout))
            ],
            **options,
        )
    except torch.distributed.DistError as err:
        raise ConnectionError(
            f"rank {launch.rank} of {launch.world_size} ({launch.launcher}) could not join the process "
            f"group at {launch.master_addr}:{launch.master_port} with {backend} "
            f"within {config.ddp_timeout} s: {err}"
        ) from err
    if accelerator.num_processes != launch.world_size:
        raise RuntimeError(
            f"{launch.launcher} started {launch.world_size} processes but Accelerate runs "
            f"{accelerator.num_processes} on {device_type} with {backend}; it cannot use that backend here"
        )
    return accelerator, f"{backend or 'no'} backend, {launch.launcher} launch"


def load_models(config: DPOConfig, device: torch.device) -> tuple[ProteinMPNN, ProteinMPNN | None]:
    """The policy, and the reference (None when reference-free): frozen, in eval mode, on `device`, never
    wrapped for DDP."""
    overrides = {"augment_eps": config.backbone_noise, **({"dropout": 0.0} if config.disable_dropout else {})}
    model = load_model(config.model_name_or_path, **overrides)
    reference = None
    if not config.reference_free:
        reference = load_model(config.ref_model_name_or_path or config.model_name_or_path, augment_eps=0.0)
        reference.to(device).eval().requires_grad_(False)
    return model, reference


def train(config: DPOConfig) -> dict[str, float]:
    """Run DPO; returns the final eval metrics (empty without an eval set)."""
    output_dir = Path(config.output_dir)
    accelerator, setup = build_accelerator(
        config,
        log_with=None if config.report_to == ["none"] else config.report_to,
        project_dir=str(output_dir),
    )
    set_seed(config.seed)
    if not accelerator.is_main_process:
        datasets.disable_progress_bars()

    train_data, eval_data = load_data(accelerator, config)

    model, reference = load_models(config, accelerator.device)
    if config.precompute_ref_log_probs:
        train_data = precompute_reference(accelerator, reference, train_data, config)
        if eval_data is not None:
            eval_data = precompute_reference(accelerator, reference, eval_data, config)
        reference = None

    train_set = PreferenceDataset(train_data)
    global_batch = config.per_device_train_batch_size * accelerator.num_processes
    sampler = LengthGroupedSampler(train_set.lengths, global_batch, config.seed)
    loader_options = {
        "collate_fn": collate,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": accelerator.device.type == "cuda",
    }
    train_loader = DataLoader(
        train_set, batch_size=config.per_device_train_batch_size, sampler=sampler, **loader_options
    )
    eval_loader, recovery_structures = None, None
    if eval_data is not None:
        eval_loader = DataLoader(
            PreferenceDataset(eval_data), batch_size=config.per_device_eval_batch_size, **loader_options
        )
        recovery_structures = eval_structures(accelerator, eval_data)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )

    steps_per_epoch = math.ceil(len(train_loader) / config.gradient_accumulation_steps)
    total_steps = (
        config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    )
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    scheduler = get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=config.warmup_steps or math.ceil(config.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
    accelerator.register_for_checkpointing(scheduler)
    eval_every = config.eval_steps or steps_per_epoch
    save_every = config.save_steps or steps_per_epoch

    state = TrainerState()
    if config.resume_from_checkpoint:
        checkpoint = find_checkpoint(output_dir, config.resume_from_checkpoint)
        if checkpoint is None:
            accelerator.print(f"No checkpoint in {output_dir / 'checkpoints'} yet: starting from step 0")
        else:
            accelerator.load_state(str(checkpoint))
            state = TrainerState.load(checkpoint)
            accelerator.print(f"Resumed from {checkpoint} at step {state.global_step}")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    accelerator.init_trackers(config.run_name, config=config.to_dict())
    accelerator.print(
        f"{len(train_set)} training pairs, {0 if eval_data is None else len(eval_data.pairs)} eval pairs; "
        f"{accelerator.num_processes} process(es) on {accelerator.device} ({setup}); batch "
        f"{config.per_device_train_batch_size} per device, global batch "
        f"{global_batch * config.gradient_accumulation_steps}; {total_steps} optimizer steps"
    )

    model.train()
    progress = tqdm(
        total=total_steps, initial=state.global_step, disable=not accelerator.is_main_process, desc="DPO"
    )
    totals, count, grad_norm = torch.zeros(len(METRICS), dtype=torch.float64), 0, torch.tensor(0.0)
    finite, skipped, nonfinite_in_a_row = True, 0, 0
    stop: TrainingStopped | None = None
    last_log = time.perf_counter()
    eval_metrics: dict[str, float] = {}
    with StopSignals(accelerator) as signals:
        for epoch in range(state.epoch, num_epochs):
            train_loader.set_epoch(epoch)
            loader = train_loader
            if epoch == state.epoch and state.batches_in_epoch:
                loader = accelerator.skip_first_batches(train_loader, state.batches_in_epoch)
            else:
                state.batches_in_epoch = 0
            state.epoch = epoch
            for batch in loader:
                with accelerator.accumulate(model):
                    loss, per_pair = step_metrics(config, model, reference, batch, epoch)
                    accelerator.backward(loss)
                    gathered = accelerator.gather_for_metrics(per_pair).double().cpu()
                    finite &= bool(gathered[:, 0].isfinite().all())  # the losses of all ranks
                    if accelerator.sync_gradients:
                        # gradients are all-reduced, losses gathered: every rank takes the same decision
                        grad_norm = accelerator.clip_grad_norm_(
                            model.parameters(), config.max_grad_norm or math.inf
                        )
                        finite &= bool(grad_norm.isfinite())
                        if finite:
                            optimizer.step()
                            scheduler.step()
                        elif accelerator.scaler is not None:
                            accelerator.scaler.update()  # fp16: lower the loss scale, as AMP does on overflow
                    optimizer.zero_grad()
                totals += gathered.sum(0)
                count += len(gathered)
                if config.log_data_order:
                    record = {"step": state.global_step + 1, "epoch": epoch, "batch": state.batches_in_epoch}
                    record["indices"] = accelerator.gather(batch["index"]).view(accelerator.num_processes, -1)
                    if accelerator.is_main_process:
                        with open(output_dir / "data_order.jsonl", "a") as handle:
                            handle.write(json.dumps({**record, "indices": record["indices"].tolist()}) + "\n")
                state.batches_in_epoch += 1
                if not accelerator.sync_gradients:
                    continue

                state.global_step += 1
                skipped += not finite
                nonfinite_in_a_row = 0 if finite else nonfinite_in_a_row + 1
                finite = True
                signalled = signals.received_on_any_rank()
                if nonfinite_in_a_row >= config.max_consecutive_nonfinite:
                    stop = diverged(output_dir, state.global_step, nonfinite_in_a_row)
                elif signalled and state.global_step < total_steps:
                    stop = interrupted(output_dir, state.global_step, total_steps)
                progress.update(1)
                progress.set_postfix(loss=f"{totals[0] / count:.4f}")
                if state.global_step % config.logging_steps == 0 or state.global_step == total_steps or stop:
                    now = time.perf_counter()
                    metrics = dict(zip(METRICS, (totals / count).tolist(), strict=True))
                    metrics.update(
                        grad_norm=float(grad_norm),
                        skipped_steps=skipped,
                        learning_rate=scheduler.get_last_lr()[0],
                        epoch=epoch + state.batches_in_epoch / len(train_loader),
                        pairs_per_second=count / (now - last_log),
                    )
                    log(accelerator, output_dir, metrics, state.global_step)
                    totals, count, skipped, last_log = totals.zero_(), 0, 0, now
                if (
                    eval_loader is not None
                    and not stop
                    and (state.global_step % eval_every == 0 or state.global_step == total_steps)
                ):
                    eval_metrics = evaluate(
                        accelerator, config, model, reference, eval_loader, recovery_structures
                    )
                    log(accelerator, output_dir, eval_metrics, state.global_step)
                    if accelerator.is_main_process:
                        progress.write(
                            f"step {state.global_step}: eval loss {eval_metrics['eval_loss']:.4f}, "
                            f"reward accuracy {eval_metrics['eval_rewards/accuracies']:.3f}, "
                            f"margin {eval_metrics['eval_rewards/margins']:.3f}, "
                            f"greedy recovery {eval_metrics['eval_recovery']:.3f}"
                        )
                    if eval_metrics["eval_loss"] < state.best_eval_loss:
                        state.best_eval_loss = eval_metrics["eval_loss"]
                        save_model(accelerator, model, output_dir / "best")
                if state.global_step % save_every == 0 or state.global_step == total_steps or stop:
                    save_checkpoint(accelerator, config, state)
                if stop or state.global_step >= total_steps:
                    break
            if stop or state.global_step >= total_steps:
                break
    progress.close()
    if stop:
        accelerator.print(stop)
        accelerator.end_training()
        raise stop

    check_replicas_agree(accelerator, model)
    save_model(accelerator, model, output_dir / "final")
    if eval_metrics:
        accelerator.print(
            f"Done: eval loss {eval_metrics['eval_loss']:.4f}, reward accuracy "
            f"{eval_metrics['eval_rewards/accuracies']:.3f}, greedy recovery "
            f"{eval_metrics['eval_recovery']:.3f}; model saved to {output_dir / 'final'}"
        )
    else:
        accelerator.print(f"Done: model saved to {output_dir / 'final'}")
    if accelerator.is_main_process and importlib.util.find_spec("matplotlib") is not None:
        plot(output_dir)
    accelerator.end_training()
    return eval_metrics
