"""The DPO training loop: one Accelerator, read top to bottom."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
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

from dpo_inv.checkpoints import TrainerState, find_checkpoint, save_checkpoint, save_model
from dpo_inv.config import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NONFINITE, DPOConfig
from dpo_inv.data import (
    REFERENCE_COLUMNS,
    SEQUENCE_FIELDS,
    DataError,
    LengthGroupedSampler,
    PairDataset,
    PreferenceDataset,
    collate,
    load_pairs,
    load_saved_pairs,
)
from dpo_inv.evaluation import describe, eval_structures, improved, run_evaluation
from dpo_inv.launch import device_backend, setup_environment, threads_per_process
from dpo_inv.loss import METRICS, batch_ranks, pair_logps
from dpo_inv.model import ProteinMPNN, load_model
from dpo_inv.objective import step_metrics
from dpo_inv.plot import plot
from dpo_inv.progress import progress
from dpo_inv.variants import LabelledVariants, variant_labels

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what PBS and SLURM send before the walltime


class TrainingStopped(Exception):
    """Training ended early and rank 0 has said why; `exit_code` is the exit status to report."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


def load_data(
    accelerator: Accelerator, config: DPOConfig
) -> tuple[PairDataset, PairDataset | None, LabelledVariants | None]:
    """Rank 0 validates the data files and parses their structures into the Arrow cache, before training;
    the other ranks then read its result from there. Bad input stops every rank, rank 0 reporting it.
    Returns the training pairs, the eval pairs and the labelled eval variants (each None when not given)."""
    names = [config.train_file, *([config.eval_file] if config.eval_file else [])]
    options = {"structure_roots": config.structure_root or (), "on_bad_record": config.on_bad_record}
    loaded: list[PairDataset] = []
    variants: LabelledVariants | None = None
    failure: Exception | None = None
    if accelerator.is_main_process:
        try:
            loaded, variants = validate(config, names, options)
            splits = train_and_eval(config, loaded)  # an impossible eval_split fails here, on rank 0 alone
        except Exception as err:  # raised below, once the other ranks know
            failure = err
    # the cache folders of the validated data (and the variant labels), or the exit status of the others
    outcome: tuple | int = (
        [data.files for data in loaded],
        variants and (variants.data.files, variants.labels),
    )
    if failure is not None:
        outcome = EXIT_BAD_INPUT if isinstance(failure, DataError) else 1
    (outcome,) = broadcast_object_list([outcome])
    if failure is not None:
        raise failure
    if isinstance(outcome, int):
        raise TrainingStopped("rank 0 could not load the data", outcome)
    if accelerator.is_main_process:
        write_skipped(accelerator, config, loaded)
        return (*splits, variants)
    files, saved_variants = outcome
    saved = [load_saved_pairs(f, name) for f, name in zip(files, names, strict=True)]
    if saved_variants is not None:
        variants = LabelledVariants(
            load_saved_pairs(saved_variants[0], config.eval_variants_file), saved_variants[1]
        )
    return (*train_and_eval(config, saved), variants)


def validate(
    config: DPOConfig, names: list[str], options: dict
) -> tuple[list[PairDataset], LabelledVariants | None]:
    """Load and check every data file; one `DataError` reports the bad records of all of them."""
    loaded, errors, variants = [], [], None
    for name in names:
        try:
            loaded.append(load_pairs(name, config.cache_dir, config.dataset_num_proc, **options))
        except DataError as err:
            errors.append(str(err))
    if config.eval_variants_file:
        try:
            data = load_pairs(
                config.eval_variants_file,
                config.cache_dir,
                config.dataset_num_proc,
                fields=SEQUENCE_FIELDS,
                structure_roots=options["structure_roots"],
            )
            variants = LabelledVariants(data, variant_labels(config.eval_variants_file))
        except DataError as err:
            errors.append(str(err))
    if errors:
        raise DataError("\n".join(errors))
    return loaded, variants


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
    for batch in progress(loader, desc="Reference log-probs", disable=not accelerator.is_main_process):
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
    threads = threads_per_process(launch.local_world_size)
    torch.set_num_threads(threads)
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
    setup = f"{backend or 'no'} backend, {launch.launcher} launch, {threads} thread(s) each"
    return accelerator, setup


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

    train_data, eval_data, variants = load_data(accelerator, config)

    model, reference = load_models(config, accelerator.device)
    accelerator.print(
        f"Policy {config.model_name_or_path}; reference "
        + (
            "none"
            if config.reference_free
            else config.ref_model_name_or_path or "the policy's starting weights"
        )
    )
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
    accelerator.init_trackers(config.run_name, config=config.to_sanitized_dict())
    evals = f"{0 if eval_data is None else len(eval_data.pairs)} eval pairs"
    evals += f", {len(variants.labels)} eval variants" if variants is not None else ""
    accelerator.print(
        f"{len(train_set)} training pairs, {evals}; {accelerator.num_processes} process(es) on "
        f"{accelerator.device} ({setup}); batch {config.per_device_train_batch_size} per device, global "
        f"batch {global_batch * config.gradient_accumulation_steps}; {total_steps} optimizer steps"
    )

    has_eval = eval_loader is not None or variants is not None

    def evaluate_and_keep_best() -> dict[str, float]:
        """Evaluate, log, and save the model as best/ when metric_for_best_model improved."""
        metrics = run_evaluation(
            accelerator, config, model, reference, eval_loader, recovery_structures, variants
        )
        log(accelerator, output_dir, metrics, state.global_step)
        if accelerator.is_main_process:
            tqdm.write(f"step {state.global_step}: {describe(metrics)}")
        if improved(config, metrics, state):
            save_model(accelerator, model, output_dir / "best")
        return metrics

    eval_metrics: dict[str, float] = {}
    if config.eval_on_start and state.global_step == 0 and has_eval:
        eval_metrics = evaluate_and_keep_best()
    model.train()
    bar = progress(
        total=total_steps,
        initial=state.global_step,
        disable=not accelerator.is_main_process,
        desc="DPO",
        unit="step",
    )
    totals, count, grad_norm = torch.zeros(len(METRICS), dtype=torch.float64), 0, torch.tensor(0.0)
    finite, skipped, nonfinite_in_a_row = True, 0, 0
    stop: TrainingStopped | None = None
    last_log = time.perf_counter()
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
                bar.update(1)
                bar.set_postfix(loss=f"{totals[0] / count:.4f}", refresh=False)
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
                    has_eval
                    and not stop
                    and (state.global_step % eval_every == 0 or state.global_step == total_steps)
                ):
                    eval_metrics = evaluate_and_keep_best()
                if state.global_step % save_every == 0 or state.global_step == total_steps or stop:
                    save_checkpoint(accelerator, config, state)
                if stop or state.global_step >= total_steps:
                    break
            if stop or state.global_step >= total_steps:
                break
    bar.close()
    if stop:
        accelerator.print(stop)
        accelerator.end_training()
        raise stop

    check_replicas_agree(accelerator, model)
    done = f"{describe(eval_metrics)}; " if eval_metrics else ""
    if config.load_best_model_at_end and state.best_step is not None:
        if accelerator.is_main_process:
            shutil.copytree(output_dir / "best", output_dir / "final", dirs_exist_ok=True)
        accelerator.wait_for_everyone()
        done += (
            f"best {config.metric_for_best_model} {state.best_metric:.4f} at step {state.best_step}: that "
        )
    else:
        save_model(accelerator, model, output_dir / "final")
    accelerator.print(f"Done: {done}model saved to {output_dir / 'final'}")
    if accelerator.is_main_process and importlib.util.find_spec("matplotlib") is not None:
        plot(output_dir)
    accelerator.end_training()
    return eval_metrics
