"""Stopping a run early: on SIGTERM or SIGUSR1 (what PBS and SLURM send before the walltime), or after too
many non-finite steps, always at an optimizer step with a checkpoint."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import torch
from accelerate import Accelerator

from dpo_inv.data.records import DataError
from dpo_inv.training.exits import EXIT_INTERRUPTED, EXIT_NONFINITE

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what PBS and SLURM send before the walltime


class TrainingStopped(Exception):
    """Training ended early, on every rank; the message says why, `exit_code` is the exit status to report."""

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


@contextmanager
def ending(accelerator: Accelerator) -> Iterator[None]:
    """End the job's trackers and leave the process group (`accelerator.end_training()`), every rank
    together when they all ended well. On a stop that every rank takes (TrainingStopped, DataError) only
    the trackers end: the command runner (`dpo_inv.cli`) leaves the group once rank 0 has said why.
    Left without a barrier, a rank could reach interpreter shutdown while gloo's threads still release the
    last collective's tensors, and abort."""
    try:
        yield
    except (TrainingStopped, DataError):
        for tracker in accelerator.trackers:
            tracker.finish()
        raise
    except BaseException:
        accelerator.end_training()
        raise
    accelerator.wait_for_everyone()
    accelerator.end_training()


def leave_process_group() -> None:
    """On a stop that every rank takes together: wait until all have said what they had to say (rank 0
    may be printing why), then leave the process group, so that the exit does not abort in its threads."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
