"""Checkpoints: the trainer state, atomic saves, finding the one to resume from, saved models."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from dpo_inv.training.config import DPOConfig

STATE_FILE = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"step-(\d+)")


@dataclass
class TrainerState:
    """Where training stands; saved in every checkpoint beside Accelerate's state."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    best_metric: float | None = None  # of metric_for_best_model, at the model saved in best/
    best_step: int | None = None  # the step of that model
    start_recovery: float | None = None  # eval_native_recovery of the starting model (eval_on_start)

    def save(self, directory: Path) -> None:
        """Written last, with the size of every file of the checkpoint: a damaged checkpoint is recognised."""
        files = {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}
        (directory / STATE_FILE).write_text(json.dumps({**asdict(self), "files": files}, indent=2))

    @classmethod
    def load(cls, directory: Path) -> TrainerState:
        fields = json.loads((directory / STATE_FILE).read_text())
        del fields["files"]
        return cls(**fields)


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
