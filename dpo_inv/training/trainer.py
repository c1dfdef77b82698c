"""The training loop: one Accelerator, read top to bottom. `fit` trains a model on a run's data; `train`
is the whole `dpo_inv.run` job around it (and `dpo_inv.train` in Python); rounds call `fit` once per
round."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import AutocastKwargs, InitProcessGroupKwargs, TorchDynamoPlugin, set_seed
from peft import PeftModel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.integrations.integration_utils import rewrite_logs

from dpo_inv.data.batches import ExampleDataset, LengthGroupedSampler, ResidueBatchSampler, collate
from dpo_inv.data.dataset import column
from dpo_inv.data.progress import progress
from dpo_inv.data.records import Data, is_file
from dpo_inv.errors import OptionError
from dpo_inv.models.adapters import (
    WithoutAdapters,
    adapter_base,
    is_adapter,
    load_adapter,
    load_adapter_weights,
    trainable_parameters,
    without_adapter_dropout,
)
from dpo_inv.models.layers import use_activation_checkpointing, use_fused_kernels
from dpo_inv.models.mpnn import derive_seed
from dpo_inv.models.weights import load_model
from dpo_inv.training.checkpoints import (
    TrainerState,
    find_checkpoint,
    save_checkpoint,
    save_folder,
    save_model,
    truncate_log,
)
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.evaluation import describe, eval_structures, run_evaluation, update_best
from dpo_inv.training.graphs import GraphedStep, Step
from dpo_inv.training.launch import (
    check_processes_asked,
    cpu_computes_bf16,
    device_backend,
    resolve_device,
    return_freed_memory,
    reuse_freed_memory,
    say,
    setup_environment,
    threads_kept,
    threads_per_process,
)
from dpo_inv.training.loading import RunData, load_data, precompute_reference, save_in_memory
from dpo_inv.training.loss import batch_ranks
from dpo_inv.training.model_card import Trained, write_model_card
from dpo_inv.training.objective import Rows, add_rows, batch_objective, summarize
from dpo_inv.training.output_lock import output_lock
from dpo_inv.training.plot import plot
from dpo_inv.training.stopping import StopSignals, TrainingStopped, diverged, ending, interrupted


def build_optimizer(config: DPOConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW on the trained weights (with use_peft, the adapters), fused or not as ``config.optim`` says."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
        fused=config.optim == "adamw_torch_fused",
    )


def build_step(
    config: DPOConfig, model: torch.nn.Module, reference: torch.nn.Module | None, accelerator: Accelerator
) -> Step:
    """Forward and backward of a micro-batch under decoding ranks, its loss detached: the plain step, or
    with cuda_graphs the same step replayed from a CUDA graph per batch shape."""

    def step(batch: dict[str, torch.Tensor], ranks: torch.Tensor) -> tuple[torch.Tensor, Rows]:
        loss, rows = batch_objective(config, model, reference, batch, ranks, accelerator)
        accelerator.backward(loss)
        return loss.detach(), rows

    if not config.cuda_graphs:
        return step
    return GraphedStep(step, [p for p in model.parameters() if p.requires_grad])


def build_accelerator(config: DPOConfig, **options: Any) -> tuple[Accelerator, str]:
    """The Accelerator for the launch environment (process group, backend, precision, compilation) and a
    description of the set-up; `options` go to the Accelerator (trackers, project folder)."""
    launch = setup_environment()
    check_processes_asked(launch.world_size)
    check_precision(config)
    if config.cuda_graphs and launch.world_size > 1:
        raise OptionError(
            f"cuda_graphs captures one process's step; {launch.world_size} were launched: launch one, or "
            "drop cuda_graphs"
        )
    threads = threads_per_process(launch.local_world_size)
    reuse_freed_memory()
    # values below float32's (and bf16's) least normal, 1.2e-38, computed as zero: x86 CPUs take about a
    # hundred times longer on them, and the per-edge gradients hold some (5% of a weight gradient's inputs in
    # the compiled step). Threads started from here on inherit it: from the command line, all of torch's
    # threads; in a notebook that computed before, only the main thread (docs/benchmarks.md)
    torch.set_flush_denormal(True)
    if config.torch_compile:
        # the layers' floats (dropout rates, layer-norm eps, the message scale) are constants: traced with
        # dynamic shapes as symbolic floats, they fail to become tensors and Dynamo traces each region twice
        torch._dynamo.config.specialize_float = True
    device_type, backend = device_backend(config.backend) if launch.world_size > 1 else (None, None)
    if launch.world_size == 1:
        # Accelerate keeps a process's first job's state (precision, compilation) and refuses or ignores
        # another job's: a later job in the process (a notebook's next cell, the API called again) starts
        # from none, as in a new process; one process of a launch has only its one job
        AcceleratorState._reset_state()
    try:
        with threads_kept(threads):
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
                    InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=config.ddp_timeout)),
                    # a captured step casts the weights in its graph: no cast kept from one step to the next
                    AutocastKwargs(cache_enabled=False if config.cuda_graphs else None),
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


def check_precision(config: DPOConfig) -> None:
    """fp16 and tf32 as Transformers takes them: on a GPU only (tf32 on NVIDIA's); tf32 set for torch;
    cuda_graphs on an NVIDIA GPU."""
    device = resolve_device(None).type
    if config.mixed_precision == "fp16" and device == "cpu":
        raise OptionError(
            "mixed_precision fp16 (fp16 true) needs a GPU: on a CPU use bf16 (native on CPUs with AVX-512 "
            "BF16 or AMX) or no"
        )
    if config.cuda_graphs and device != "cuda":
        raise OptionError(f"cuda_graphs needs an NVIDIA GPU, not {device}: drop cuda_graphs")
    if config.tf32 is not None:
        if device != "cuda" and config.tf32:
            raise OptionError(f"tf32 true needs an NVIDIA GPU (Ampere or newer), not {device}: drop tf32")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.tf32


def model_overrides(config: DPOConfig) -> dict[str, float]:
    """The policy's training settings: backbone noise (where set) and no dropout with disable_dropout,
    by default on for preference losses and off for sft."""
    sft = config.record_kind == "structures"
    noise = {} if config.backbone_noise is None else {"augment_eps": config.backbone_noise}
    disable = not sft if config.disable_dropout is None else config.disable_dropout
    return {**noise, **({"dropout": 0.0} if disable else {})}


def load_policy(config: DPOConfig, name: str | os.PathLike) -> torch.nn.Module:
    """The policy to train from the weights `name`: the model, or with use_peft the model with a new LoRA
    adapter (the adapter of `name` trained on where it is an adapter folder); no dropout anywhere with
    disable_dropout, the adapters' included, as TRL does."""
    overrides = model_overrides(config)
    if not config.use_peft:
        return load_model(name, **overrides)
    if is_adapter(name):
        model = load_adapter(name, load_model(adapter_base(name), **overrides), trainable=True)
    else:
        model = config.adapter(load_model(name, **overrides))
    if overrides.get("dropout") == 0.0:
        without_adapter_dropout(model)
    return model


def load_models(
    config: DPOConfig, device: torch.device, start: str | os.PathLike | None = None
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (from `start`, by default model_name_or_path), and the reference (None when
    reference-free or for sft): frozen, in eval mode, on `device`, never wrapped for DDP; with use_peft and
    no ref_model_name_or_path, the policy itself with its adapters switched off. Without a backbone_noise,
    the policy trains with the noise its weights were trained with for sft, none otherwise. Each rank
    loads its own copy: a rank that cannot (a file missing on its node) fails alone, naming the cause, and
    its launcher ends the job."""
    model = load_policy(config, start or config.model_name_or_path)
    if config.backbone_noise is None:
        sft = config.record_kind == "structures"
        model.config.augment_eps = float(model.config.noise_level or 0.0) if sft else 0.0
    reference = None
    if not config.reference_free and config.record_kind != "structures":
        if config.use_peft and not config.ref_model_name_or_path:
            reference = WithoutAdapters(model.to(device))
        else:
            name = config.ref_model_name_or_path or config.model_name_or_path
            reference = load_model(name, augment_eps=0.0).to(device).eval().requires_grad_(False)
    for loaded in (model, reference):
        if loaded is not None:
            use_fused_kernels(loaded, config.fused_kernels)
    use_activation_checkpointing(model, config.checkpointed_every)
    return model, reference


def check_replicas_agree(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Every rank must hold the same parameters after training; a broken process group shows here."""
    params = [
        p.detach().double().sum()
        for p in accelerator.unwrap_model(model, keep_torch_compile=False).parameters()
    ]
    sums = accelerator.gather(torch.stack(params).unsqueeze(0).to(accelerator.device)).cpu()
    if not torch.equal(sums, sums[:1].expand_as(sums)):
        raise RuntimeError("parameters differ between ranks after training: gradients were not synchronised")
    say(accelerator, f"Parameters identical on all {accelerator.num_processes} process(es)")


MAX_PASSES = 100  # more passes over the training data than this are announced as overfitting
FEW_STRUCTURES = 5  # an eval split that leaves fewer training structures than this is announced
GPU_RESIDUES = 10_000  # residues of a micro-batch that fills an H100 or H200 (docs/benchmarks.md#on-a-gpu)
UNITS = {"pairs": "pairs", "labelled": "sequences", "structures": "structure records"}  # by record kind
BF16_EMULATED = (
    "bf16 autocast on a CPU without native bf16 (AVX-512 BF16 or AMX) is emulated, several "
    "times slower than fp32 (docs/benchmarks.md): --mixed_precision no"
)
FP32_ON_A_GPU = (
    "fp32 on a GPU: --mixed_precision bf16 takes 40% less memory and, from batches of 32 up, is 1.3-1.5 "
    "times as fast (docs/benchmarks.md#on-a-gpu)"
)


@dataclass
class Steps:
    """How long a run is, in optimizer steps, and how often it logs, evaluates and saves."""

    per_epoch: int
    total: int
    epochs: int
    log_every: int | None  # None: never (logging_strategy, eval_strategy, save_strategy no)
    eval_every: int | None
    save_every: int | None

    @classmethod
    def plan(cls, config: DPOConfig, batches_per_epoch: int) -> Steps:
        per_epoch = math.ceil(batches_per_epoch / config.gradient_accumulation_steps)
        total = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * per_epoch)
        return cls(
            per_epoch=per_epoch,
            total=total,
            epochs=math.ceil(total / per_epoch),
            log_every=every(config.logging_strategy, config.logging_steps, per_epoch),
            eval_every=every(config.eval_strategy, config.eval_steps, per_epoch),
            save_every=every(config.save_strategy, config.save_steps, per_epoch),
        )


def every(strategy: str, steps: int | None, per_epoch: int) -> int | None:
    """Optimizer steps between two logs, evaluations or checkpoints of a strategy; None: never."""
    return {"steps": steps, "epoch": per_epoch, "no": None}[strategy]


def due(every: int | None, step: int, last: bool) -> bool:
    """Whether a schedule of ``every`` steps (None: never) logs, evaluates or saves at ``step``, or at the
    last step of a run."""
    return every is not None and (step % every == 0 or last)


@dataclass
class Window:
    """Training metrics summed since the last log line."""

    totals: dict[str, float] = field(default_factory=dict)  # each metric's sum over the examples, by name
    count: int = 0
    skipped: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    grad_norm: float = 0.0  # of the last optimizer step
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Run:
    """One training run's objects, prepared by Accelerate, and where it stands."""

    accelerator: Accelerator
    config: DPOConfig
    model: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    eval_loader: DataLoader | None
    recovery_structures: list[dict]
    data: RunData
    steps: Steps
    step: Step  # forward and backward of a micro-batch under decoding ranks
    state: TrainerState = field(default_factory=TrainerState)
    eval_metrics: dict[str, float] = field(default_factory=dict)  # of the last evaluation
    train_metrics: dict[str, float] = field(default_factory=dict)  # of the last training log line
    log_step_offset: int = 0  # added to the step in the trackers (rounds train one run after another)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def has_eval(self) -> bool:
        return self.eval_loader is not None or self.data.variants is not None

    def log(self, metrics: dict[str, float]) -> None:
        """Rank 0 appends one JSON object to metrics.jsonl (TRL's log names: loss, eval_loss); the trackers
        get it with TRL's tags (train/loss, eval/loss)."""
        if self.accelerator.is_main_process:
            with open(self.output_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps({"step": self.state.global_step, **metrics}) + "\n")
        self.accelerator.log(rewrite_logs(metrics), step=self.log_step_offset + self.state.global_step)


def prepare_run(
    accelerator: Accelerator,
    config: DPOConfig,
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    data: RunData,
) -> Run:
    """Loaders, optimizer and schedule, prepared for this launch; the reference's log-probs precomputed
    when asked (the reference is then dropped), and always those of the eval pairs where the loss needs
    only their sums: the reference is fixed, so every evaluation would compute the same."""
    if config.precompute_ref_log_probs:
        data = RunData(
            precompute_reference(accelerator, reference, data.train, config),
            data.eval and precompute_reference(accelerator, reference, data.eval, config),
            data.variants,
        )
        reference = None
    elif data.eval is not None and config.reference_sums_only:
        data = RunData(
            data.train, precompute_reference(accelerator, reference, data.eval, config), data.variants
        )
    train_set = ExampleDataset(data.train)
    options = {
        "collate_fn": partial(collate, pad_to_multiple_of=config.pad_to_multiple_of),
        "num_workers": config.dataloader_num_workers,
        "pin_memory": accelerator.device.type == "cuda",
    }
    train_loader = DataLoader(
        train_set, **train_batches(config, train_set.lengths, accelerator.num_processes), **options
    )
    eval_loader, recovery_structures = None, []
    if data.eval is not None:
        eval_loader = DataLoader(ExampleDataset(data.eval), config.per_device_eval_batch_size, **options)
        recovery_structures = eval_structures(accelerator, data.eval)
    optimizer = build_optimizer(config, model)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    steps = Steps.plan(config, len(train_loader))
    scheduler = get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=config.warmup(steps.total),
        num_training_steps=steps.total,
    )
    accelerator.register_for_checkpointing(scheduler)
    step = build_step(config, model, reference, accelerator)
    return Run(accelerator, config, model, reference, optimizer, scheduler, train_loader, eval_loader,
               recovery_structures, data, steps, step)  # fmt: skip


def train_batches(config: DPOConfig, lengths: np.ndarray, num_processes: int) -> dict[str, Any]:
    """How the training DataLoader batches (its keyword arguments), before Accelerate shards it: by
    per_device_train_batch_residues (`ResidueBatchSampler`: global batches of one micro-batch per process),
    else per_device_train_batch_size pairs grouped by length over the global batch; seeded, by epoch."""
    if config.per_device_train_batch_residues:
        budget = config.per_device_train_batch_residues
        return {"batch_sampler": ResidueBatchSampler(lengths, budget, config.seed, num_processes)}
    global_batch = config.per_device_train_batch_size * num_processes
    return {
        "batch_size": config.per_device_train_batch_size,
        "sampler": LengthGroupedSampler(lengths, global_batch, config.seed),
    }


def resume(run: Run) -> None:
    """With resume_from_checkpoint: load the newest (or the given) checkpoint's state, if there is one. The
    logs then hold the run's lines up to its step: none from step 0 (an earlier run in the same output_dir,
    or one killed before its first checkpoint, left its own), those to the checkpoint's step on resuming (a
    run killed after its last checkpoint logged further steps)."""
    wanted = run.config.resume_from_checkpoint
    checkpoint = find_checkpoint(run.output_dir, wanted) if wanted else None
    if checkpoint is not None:
        run.accelerator.load_state(str(checkpoint))
        run.state = TrainerState.load(checkpoint)
    if run.accelerator.is_main_process:
        for log in ("metrics.jsonl", "data_order.jsonl"):
            truncate_log(run.output_dir / log, run.state.global_step if checkpoint else -1)
    if checkpoint is not None:
        say(run.accelerator, f"Resumed from {checkpoint} at step {run.state.global_step}")
    elif wanted:
        say(run.accelerator, f"No checkpoint in {run.output_dir / 'checkpoints'} yet: starting from step 0")


def announce(run: Run, setup: str) -> None:
    """Write config.yaml; say what is trained on what, with how many processes and steps."""
    accelerator, config, data = run.accelerator, run.config, run.data
    if accelerator.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    unit = UNITS[config.record_kind]
    evals = f"{0 if data.eval is None else len(data.eval.records)} eval {unit}"
    evals += f", {len(data.variants.labels)} eval variants" if data.variants is not None else ""
    say(
        accelerator,
        f"{len(data.train.records)} training {unit}, {evals}; {accelerator.num_processes} process(es) on "
        f"{accelerator.device} ({setup}); {batch_line(run, unit)}; {run.steps.total} optimizer steps",
    )
    for note in data_notes(config, data, run.steps) + device_notes(config, data, accelerator.device):
        say(accelerator, f"Note: {note}")


def batch_line(run: Run, unit: str) -> str:
    """The start-up line's batch: per device, and global (all processes, all accumulated micro-batches)."""
    config, processes = run.config, run.accelerator.num_processes
    per_step = processes * config.gradient_accumulation_steps
    budget = config.per_device_train_batch_residues
    if budget:
        mean = len(run.data.train.records) / (len(run.train_loader) * processes)
        return (
            f"batch {budget} residues per device (examples × longest length; {mean:.1f} {unit} on average), "
            f"global batch {budget * per_step} residues"
        )
    return (
        f"batch {config.per_device_train_batch_size} per device, global batch "
        f"{config.per_device_train_batch_size * per_step}"
    )


def data_notes(config: DPOConfig, data: RunData, steps: Steps) -> list[str]:
    """What would make a run not what its user meant: many passes over the data, structures longer than the
    residue budget of a micro-batch, an eval split that leaves a few structures to train on or none to
    evaluate on."""
    notes = []
    unit = UNITS[config.record_kind]
    passes = steps.total / steps.per_epoch
    if passes > MAX_PASSES:
        notes.append(
            f"{steps.total} optimizer steps pass over the {len(data.train.records)} training {unit} "
            f"{passes:.0f} times (more than {MAX_PASSES}), which overfits them; lower max_steps or give more "
            "data"
        )
    budget = config.per_device_train_batch_residues
    if budget:
        lengths = data.train.lengths()
        longer = len(np.unique(column(data.train.records, "structure_id")[lengths > budget]))
        if longer:
            notes.append(
                f"{longer} training structure(s) longer than per_device_train_batch_residues {budget} (the "
                f"longest: {lengths.max()} residues): each of their {unit} is a micro-batch alone"
            )
    structures = len(np.unique(column(data.train.records, "structure_id")))
    if config.eval_file is None and config.eval_split > 0 and data.eval is None and structures == 1:
        notes.append(
            f"eval_split={config.eval_split} holds out whole structures and the training data has one: "
            "nothing held out, no eval metrics; give an eval_file to evaluate"
        )
    split = data.eval is not None and data.eval.source == data.train.source  # eval_split held out of train
    if split and structures < FEW_STRUCTURES:
        held_out = len(np.unique(column(data.eval.records, "structure_id")))
        notes.append(
            f"eval_split={config.eval_split} held out {held_out} of {held_out + structures} structures "
            f"({len(data.eval.records)} {unit}), leaving {structures} to train on; give an eval_file, or "
            "eval_split 0 to train on all"
        )
    return notes


def device_notes(config: DPOConfig, data: RunData, device: torch.device) -> list[str]:
    """What leaves the device slow: bf16 emulated on a CPU; on a GPU, fp32 where it computes bf16, and
    micro-batches of far fewer residues than fill it (the default of 8 pairs: about 1,000)."""
    if device.type == "cpu":
        emulated = config.mixed_precision == "bf16" and cpu_computes_bf16() is False
        return [BF16_EMULATED] if emulated else []
    if device.type != "cuda":
        return []
    fp32 = config.mixed_precision == "no" and torch.cuda.is_bf16_supported(including_emulation=False)
    notes = [FP32_ON_A_GPU] if fp32 else []
    if not config.per_device_train_batch_residues:
        size, mean = config.per_device_train_batch_size, data.train.lengths().mean()
        if size * mean < GPU_RESIDUES / 2:
            notes.append(
                f"a micro-batch of {size} {UNITS[config.record_kind]} holds about {size * mean:,.0f} "
                f"residues (structures of {mean:.0f} on average), a fraction of what fills a GPU: "
                f"--per_device_train_batch_residues {GPU_RESIDUES} or more "
                "(docs/training.md#batches-measured-in-residues)"
            )
    return notes


def evaluate(run: Run) -> None:
    """Evaluate and log; save the model as best/ when it is the new best."""
    run.eval_metrics = run_evaluation(run.accelerator, run.config, run.model, run.reference, run.eval_loader,
                                      run.recovery_structures, run.data.variants)  # fmt: skip
    run.log(run.eval_metrics)
    if run.accelerator.is_main_process:
        tqdm.write(f"step {run.state.global_step}: {describe(run.eval_metrics)}")
    if update_best(run.config, run.eval_metrics, run.state):
        save_model(run.accelerator, run.model, run.output_dir / "best")


def micro_step(run: Run, batch: dict[str, torch.Tensor], epoch: int) -> tuple[Rows, bool, float]:
    """Forward and backward of one micro-batch; at the end of an accumulation, the optimizer step unless
    the loss (on any rank) or the gradient norm is not finite. Returns every rank's per-example metrics,
    by name, whether the micro-batch was finite (every rank decides the same: losses are gathered,
    gradients all-reduced) and, at the end of an accumulation, the gradient norm (NaN otherwise)."""
    accelerator, model, config = run.accelerator, run.model, run.config
    # backbone noise and dropout drawn from the micro-batch's own seed: a resumed run draws what one that
    # was never stopped draws, whatever ran in between (evaluation, checkpoints)
    torch.manual_seed(derive_seed(config.seed, epoch, int(batch["index"][0]), accelerator.process_index))
    ranks = batch_ranks(batch, config.seed, config.num_decoding_orders, config.decoding_order, epoch)
    grad_norm = math.nan
    with accelerator.accumulate(model):
        _, rows = run.step(batch, ranks)
        gathered = {name: values.cpu() for name, values in accelerator.gather_for_metrics(rows).items()}
        finite = bool(gathered["loss"].isfinite().all())
        if accelerator.sync_gradients:
            max_norm = config.max_grad_norm or math.inf
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
            finite &= math.isfinite(grad_norm)
            if finite:
                run.optimizer.step()
                run.scheduler.step()
            elif accelerator.scaler is not None:
                accelerator.scaler.update()  # fp16: lower the loss scale, as AMP does on overflow
        run.optimizer.zero_grad()
    return gathered, finite, grad_norm


def log_data_order(run: Run, batch: dict[str, torch.Tensor], epoch: int) -> None:
    """With log_data_order: rank 0 writes the example indices of every rank's micro-batch."""
    indices = run.accelerator.gather(batch["index"]).view(run.accelerator.num_processes, -1)
    if run.accelerator.is_main_process:
        record = {"step": run.state.global_step + 1, "epoch": epoch, "batch": run.state.batches_in_epoch}
        with open(run.output_dir / "data_order.jsonl", "a") as handle:
            handle.write(json.dumps({**record, "indices": indices.tolist()}) + "\n")


def log_window(run: Run, window: Window, epoch: int) -> Window:
    """Log the training metrics of the window; a new window begins."""
    now = time.perf_counter()
    metrics = summarize(run.config, window.totals, window.count)
    metrics.update(
        grad_norm=window.grad_norm,
        skipped_steps=window.skipped,
        learning_rate=run.scheduler.get_last_lr()[0],
        epoch=epoch + run.state.batches_in_epoch / len(run.train_loader),
        samples_per_second=window.count / (now - window.started),
    )
    run.log(metrics)
    run.train_metrics = metrics
    return Window(started=now)


def epoch_batches(run: Run, epoch: int) -> DataLoader:
    """The epoch's micro-batches, skipping those a resumed run has already trained on."""
    run.train_loader.set_epoch(epoch)
    if epoch == run.state.epoch and run.state.batches_in_epoch:
        return run.accelerator.skip_first_batches(run.train_loader, run.state.batches_in_epoch)
    run.state.epoch, run.state.batches_in_epoch = epoch, 0
    return run.train_loader


def stop_reason(run: Run, nonfinite_in_a_row: int, signals: StopSignals) -> TrainingStopped | None:
    """Why training stops before its last step, if it does: too many non-finite steps in a row, or a
    signal on any rank."""
    step = run.state.global_step
    if nonfinite_in_a_row >= run.config.max_consecutive_nonfinite:
        return diverged(run.output_dir, step, nonfinite_in_a_row)
    if signals.received_on_any_rank() and step < run.steps.total:
        return interrupted(run.output_dir, step, run.steps.total)
    return None


def train_loop(run: Run) -> None:
    """Train to the last step: each micro-batch forward and backward, each accumulation's end an optimizer
    step, then logging, evaluation and checkpoints on their schedules. Raises TrainingStopped, with a
    checkpoint saved, on a signal or after too many non-finite steps in a row."""
    accelerator, config, state, steps = run.accelerator, run.config, run.state, run.steps
    if config.eval_on_start and state.global_step == 0 and run.has_eval:
        evaluate(run)
    run.model.train()
    window = Window()
    finite, nonfinite_in_a_row = True, 0
    name = {"pairs": "DPO", "labelled": "KTO", "structures": "SFT"}[config.record_kind]
    bar = progress(total=steps.total, initial=state.global_step, desc=name, unit="step",
                   disable=not accelerator.is_main_process)  # fmt: skip
    with StopSignals(accelerator) as signals, bar:
        for epoch in range(state.epoch, steps.epochs):
            for batch in epoch_batches(run, epoch):
                rows, batch_finite, grad_norm = micro_step(run, batch, epoch)
                finite &= batch_finite
                add_rows(window.totals, rows)
                window.count += len(rows["loss"])
                if config.log_data_order:
                    log_data_order(run, batch, epoch)
                state.batches_in_epoch += 1
                if not accelerator.sync_gradients:
                    continue
                # an optimizer step was taken, or skipped as not finite
                state.global_step += 1
                window.grad_norm, window.skipped = grad_norm, window.skipped + (not finite)
                nonfinite_in_a_row = 0 if finite else nonfinite_in_a_row + 1
                finite = True
                bar.update(1)
                bar.set_postfix(
                    loss=f"{summarize(config, window.totals, window.count)['loss']:.4f}", refresh=False
                )
                stop = stop_reason(run, nonfinite_in_a_row, signals)
                last = state.global_step >= steps.total
                first = config.logging_first_step and state.global_step == 1
                if due(steps.log_every, state.global_step, last or stop is not None) or first:
                    window = log_window(run, window, epoch)
                if run.has_eval and not stop and due(steps.eval_every, state.global_step, last):
                    evaluate(run)
                if due(steps.save_every, state.global_step, last) or stop:
                    save_checkpoint(accelerator, config, state)
                if stop:
                    raise stop
                if last:
                    return


def finish(run: Run) -> None:
    """Check the replicas agree; save final/ (the last model, or with load_best_model_at_end the best)."""
    accelerator, config, state = run.accelerator, run.config, run.state
    check_replicas_agree(accelerator, run.model)
    done = f"{describe(run.eval_metrics)}; " if run.eval_metrics else ""
    if config.load_best_model_at_end and state.best_step is not None:

        def copy_best(partial: Path) -> None:
            if accelerator.is_main_process:
                shutil.copytree(run.output_dir / "best", partial)

        save_folder(accelerator, run.output_dir, run.output_dir / "final", copy_best)
        done += (
            f"best {config.metric_for_best_model} {state.best_metric:.4f} at step {state.best_step}: that "
        )
        chosen = f"the model of the best {config.metric_for_best_model}, at step {state.best_step}"
    else:
        save_model(accelerator, run.model, run.output_dir / "final")
        chosen = f"the model of the last step, {state.global_step}"
    if accelerator.is_main_process:
        write_model_card(config, trained_summary(run, chosen), run.output_dir / "final")
    say(accelerator, f"Done: {done}model saved to {run.output_dir / 'final'}")
    if accelerator.is_main_process and importlib.util.find_spec("matplotlib") is not None:
        plot(run.output_dir)


def trained_summary(run: Run, chosen: str) -> Trained:
    """What the model card says was trained: the data, the steps, which model, the last metrics."""
    data = run.data
    return Trained(
        examples=len(data.train.records),
        structures=len(np.unique(column(data.train.records, "structure_id"))),
        eval_examples=0 if data.eval is None else len(data.eval.records),
        steps=run.state.global_step,
        epochs=run.state.global_step / run.steps.per_epoch,
        chosen=chosen,
        metrics={**run.train_metrics, **run.eval_metrics},
        ligand=run.accelerator.unwrap_model(run.model).config.ligand_mpnn_family,
    )


@dataclass
class Fitted:
    """A trained model (unwrapped; the best one with load_best_model_at_end), its last eval metrics and
    the optimizer steps of its run."""

    model: torch.nn.Module  # ProteinMPNN, or with use_peft the base with its adapters (peft's PeftModel)
    eval_metrics: dict[str, float]
    steps: int
    train_metrics: dict[str, float] = field(default_factory=dict)  # of the last log line


def fit(
    accelerator: Accelerator,
    config: DPOConfig,
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    data: RunData,
    setup: str,
    log_step_offset: int = 0,
) -> Fitted:
    """Train `model` on `data` into `config.output_dir`, resuming there when asked; final/ holds the
    trained model."""
    run = prepare_run(accelerator, config, model, reference, data)
    run.log_step_offset = log_step_offset
    resume(run)
    announce(run, setup)
    train_loop(run)
    finish(run)
    trained = accelerator.unwrap_model(run.model, keep_torch_compile=False)
    if config.load_best_model_at_end and run.state.best_step is not None:
        if isinstance(trained, PeftModel):  # the best adapter into the policy its reference switches off
            load_adapter_weights(trained, run.output_dir / "final")
        else:
            trained = load_model(run.output_dir / "final").to(accelerator.device)
    accelerator.free_memory()
    accelerator._custom_objects.clear()  # free_memory leaves the scheduler registered for checkpoints
    return_freed_memory()
    return Fitted(trained, run.eval_metrics, run.state.global_step, run.train_metrics)


def start_job(config: DPOConfig) -> tuple[Accelerator, str]:
    """The Accelerator of a job, with its trackers, and its set-up line; seeded; progress bars on rank 0."""
    accelerator, setup = build_accelerator(
        config,
        log_with=None if config.report_to == ["none"] else config.report_to,
        project_dir=config.output_dir,
    )
    set_seed(config.seed)
    if not accelerator.is_main_process:
        datasets.disable_progress_bars()
    return accelerator, setup


class TrainOutput(NamedTuple):
    """What `train` returns: the trained model (in eval mode) and its last logged training and eval
    metrics, as in metrics.jsonl."""

    model: torch.nn.Module
    metrics: dict[str, float]


def train(
    config: DPOConfig, train_dataset: Data | None = None, eval_dataset: Data | None = None
) -> TrainOutput:
    """Train a model on preference pairs (labelled sequences for kto) as `python -m dpo_inv.run` does.

    `train_dataset` and `eval_dataset` replace `config.train_file` and `config.eval_file`: a file path, a
    list of dicts, a pandas DataFrame or a `datasets.Dataset`, with the fields of a data file (relative
    structure paths are relative to the working directory). They are validated as files are: bad records
    raise one `DataError` (a `ValueError`), a line each, naming the record, what is wrong and the fix.
    Records in memory are saved into `output_dir` (train_dataset.jsonl, eval_dataset.jsonl), which
    config.yaml names. Started by `accelerate launch`, `torchrun` or `mpiexec`, every process runs it and
    they train together; otherwise (a notebook) it runs in one process.
    """
    accelerator, setup = start_job(config)
    with output_lock(accelerator, config.output_dir):
        data = load_data(accelerator, config, train_dataset, eval_dataset)
        given = {"train_file": ("train_dataset", train_dataset), "eval_file": ("eval_dataset", eval_dataset)}
        config = dataclasses.replace(  # the files config.yaml names: as given, or the records in memory saved
            config,
            **{
                field: str(data) if is_file(data) else save_in_memory(accelerator, config, name, data)
                for field, (name, data) in given.items()
                if data is not None
            },
        )
        model, reference = load_models(config, accelerator.device)
        reference_name = config.ref_model_name_or_path or "the policy's starting weights"
        reference_name = "none" if reference is None else reference_name
        noise = f"backbone noise {model.config.augment_eps:.2f} Å, dropout {model.config.dropout:g}"
        if isinstance(model, PeftModel):
            noise += f"; {trainable_parameters(model)}"
            if isinstance(reference, WithoutAdapters):
                reference_name = "the base model, adapters off"
        say(accelerator, f"Policy {config.model_name_or_path} ({noise}); reference {reference_name}")
        accelerator.init_trackers(config.run_name, config=config.to_sanitized_dict())
        with ending(accelerator):
            fitted = fit(accelerator, config, model, reference, data, setup)
    return TrainOutput(fitted.model.eval(), {**fitted.train_metrics, **fitted.eval_metrics})
