"""Checkpoints: the trainer state, atomic saves, finding the one to resume from, saved models."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from peft import PeftModel

from dpo_inv.data.saved import file_sizes, size_problem
from dpo_inv.models.adapters import save_adapter
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.exits import EXIT_NOT_SAVED
from dpo_inv.training.stopping import TrainingStopped

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
        state = {**asdict(self), "files": file_sizes(directory)}
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))

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
    return size_problem(directory, files)


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


def truncate_log(path: Path, step: int) -> None:
    """Keep the lines of a JSON-lines log (metrics.jsonl) up to `step`: a resumed run logs the later ones
    again, once."""
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step))


def remove_partial_checkpoints(checkpoints: Path) -> None:
    for partial in checkpoints.glob("*.tmp"):
        shutil.rmtree(partial)


def written_by_all(accelerator: Accelerator, write: Callable[[], object]) -> str | None:
    """Run this rank's part of a save; collective: the first rank's failure to write (a full disk or quota,
    which torch.save and safetensors report in their own words), or None when every rank wrote its part."""
    try:
        write()
        problem = None
    except Exception as err:  # OSError, or torch.save's RuntimeError or safetensors' error on a full disk
        problem = f"{type(err).__name__}: {err}".replace("\n", " ")
    problems = gather_object([problem])
    return next((f"{p} (rank {r})" if len(problems) > 1 else p for r, p in enumerate(problems) if p), None)


def not_saved(output_dir: Path, target: Path, problem: str) -> TrainingStopped:
    """The stop of a run that could not write `target`: what happened, where, the checkpoint to go on from."""
    free = shutil.disk_usage(output_dir).free / 2**20
    complete = sorted_checkpoints(output_dir)
    resume = "no checkpoint was saved before: make room, then run again"
    if complete:
        resume = (f"checkpoint {complete[-1].name} is complete: make room, then run again with --output_dir "
                  f"{output_dir} --resume_from_checkpoint latest")  # fmt: skip
    return TrainingStopped(
        f"Could not write {target}: {problem}; {free:.0f} MiB free on that file system (a full disk or quota "
        f"is the usual cause). The {resume}",
        EXIT_NOT_SAVED,
    )


def replace_directory(partial: Path, directory: Path) -> None:
    """Put the complete folder `partial` in the place of `directory`, which may exist."""
    old = directory.with_name(f"{directory.name}.old.tmp")
    if directory.exists():
        directory.rename(old)
    partial.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(accelerator: Accelerator, config: DPOConfig, state: TrainerState) -> None:
    """Save checkpoints/step-N atomically (`save_folder`), the trainer state written last; then the newest
    `save_total_limit` checkpoints, this one always, are kept."""
    output_dir = Path(config.output_dir)
    checkpoints = output_dir / "checkpoints"
    if accelerator.is_main_process:
        remove_partial_checkpoints(checkpoints)  # left by a save that was killed
    directory = checkpoints / f"step-{state.global_step}"
    save_folder(accelerator, output_dir, directory, lambda partial: accelerator.save_state(str(partial)),
                seal=state.save)  # fmt: skip
    if accelerator.is_main_process and config.save_total_limit is not None:
        newest_first = [p for p in reversed(sorted_checkpoints(output_dir)) if p != directory]
        for old in newest_first[config.save_total_limit - 1 :]:
            shutil.rmtree(old)


def save_folder(
    accelerator: Accelerator,
    output_dir: Path,
    directory: Path,
    write: Callable[[Path], object],
    seal: Callable[[Path], object] | None = None,
) -> None:
    """Write a folder of the run in `output_dir` (a checkpoint, best/, final/) atomically: every rank calls
    `write(partial)` to write its part into DIRECTORY.tmp; rank 0 then calls `seal(partial)` and puts it in
    the place of `directory`. When a rank cannot write, the partial folder is removed and the run stops
    (TrainingStopped), `directory` and the checkpoints as they were."""
    partial = directory.with_name(f"{directory.name}.tmp")

    def finish() -> None:
        if accelerator.is_main_process:
            if seal is not None:
                seal(partial)
            replace_directory(partial, directory)

    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    accelerator.wait_for_everyone()
    problem = written_by_all(accelerator, lambda: write(partial))
    problem = problem or written_by_all(accelerator, finish)
    if problem is not None:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        raise not_saved(output_dir, directory, problem)


def save_model(accelerator: Accelerator, model: torch.nn.Module, directory: Path) -> None:
    """The model as a save_pretrained folder, or with LoRA adapters as an adapter folder."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)

    def write(partial: Path) -> None:
        if isinstance(unwrapped, PeftModel):
            save_adapter(unwrapped, partial, is_main_process=accelerator.is_main_process)
        else:
            unwrapped.save_pretrained(
                partial, is_main_process=accelerator.is_main_process, save_function=accelerator.save
            )

    save_folder(accelerator, directory.parent, directory, write)
