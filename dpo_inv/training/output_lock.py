"""One job per output folder: rank 0 holds a lock on OUTPUT_DIR/run.lock while the job runs, and a second
job started on the same folder refuses, naming the first, instead of interleaving its checkpoints. The
operating system releases the lock when the job ends, however it ends (SIGKILL and the OOM killer too)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from dpo_inv.data.records import DataError

LOCK_FILE = "run.lock"


def lock_folder(stack: contextlib.ExitStack, output_dir: Path) -> str | None:
    """Lock ``output_dir``/run.lock until `stack` closes and write this job's name into it; or say which job
    holds it. A file system without locks gives a note and no lock."""
    output_dir.mkdir(parents=True, exist_ok=True)
    handle = stack.enter_context((output_dir / LOCK_FILE).open("a+"))
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        return handle.read().strip() or "a job that has not written its name yet"
    except OSError as err:
        print(f"Note: {output_dir / LOCK_FILE} cannot be locked here ({err.strerror}): a second job started "
              f"on {output_dir} would not be refused", flush=True)  # fmt: skip
        return None
    handle.truncate(0)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {' '.join(sys.argv)}\n")
    handle.flush()
    return None


@contextlib.contextmanager
def output_lock(accelerator: Accelerator, output_dir: str) -> Iterator[None]:
    """Hold `output_dir` for the job inside; every rank raises a DataError when another job holds it."""
    with contextlib.ExitStack() as stack:
        holder = lock_folder(stack, Path(output_dir)) if accelerator.is_main_process else None
        (holder,) = broadcast_object_list([holder])
        if holder is not None:
            raise DataError(
                f"{output_dir} is in use by another job ({holder}; see {Path(output_dir) / LOCK_FILE}): wait "
                "for it to end, or give another output_dir"
            )
        yield
