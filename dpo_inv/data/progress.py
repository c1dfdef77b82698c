"""Progress of long work: a tqdm bar in a terminal; in a log file (a batch job's output), one status line
at the start, every `STATUS_SECONDS` and at the end, instead of a stream of redraws."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import datasets
from tqdm.auto import tqdm

STATUS_SECONDS = 60.0


class _Lines(io.TextIOBase):
    """A stream for tqdm that writes each redraw as one line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").replace("\x1b[A", "").rstrip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable: Iterable | None = None, **options: Any) -> tqdm:
    """`tqdm(iterable, **options)`, drawn as a bar in a terminal and as periodic lines elsewhere."""
    if sys.stderr.isatty():
        return tqdm(iterable, **options)
    return tqdm(iterable, file=_Lines(sys.stderr), mininterval=STATUS_SECONDS, maxinterval=STATUS_SECONDS,
                ascii=True, **options)  # fmt: skip


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Without `datasets`' own progress bars (saving, mapping) for the duration."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()
