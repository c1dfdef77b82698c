"""Errors that blame the right party: bad input (`dpo_inv.errors.BadInput`, or an OSError about a path) is one
line per problem and exit status 2; anything else is a bug in dpo_inv: the last frames of its traceback, a
line saying so, exit status 1. Every error line starts `PROG: error: `."""

import re
from pathlib import Path

import pytest
from test_pairs import group, write

import dpo_inv.commands.plot
from dpo_inv import errors
from dpo_inv.cli import BUG_FRAMES, is_bad_input, run
from dpo_inv.data.records import DataError
from dpo_inv.structures.parse import StructureError
from dpo_inv.tools.reward_fn import RewardError


def call(capsys: pytest.CaptureFixture, command: str, *args: str) -> tuple[int, str]:
    """`dpo-inv command *args` in this process: its exit status and stderr."""
    with pytest.raises(SystemExit) as exit_:
        run(command, list(args))
    return exit_.value.code, capsys.readouterr().err


def test_the_family_is_one_class_of_value_errors_at_its_old_import_paths():
    kinds = (errors.DataError, errors.MeasurementError, errors.StructureError, errors.RewardError,
             errors.OptionError)  # fmt: skip
    assert all(issubclass(kind, errors.BadInput) and issubclass(kind, ValueError) for kind in kinds)
    assert (DataError, StructureError, RewardError) == (
        errors.DataError,
        errors.StructureError,
        errors.RewardError,
    )
    assert issubclass(errors.MeasurementError, DataError)  # said once, by rank 0, as bad records are


def test_what_counts_as_bad_input():
    assert is_bad_input(errors.OptionError("--top_k must be >= 1, got 0"))
    assert is_bad_input(FileNotFoundError(2, "No such file or directory", "pairs.jsonl"))
    assert is_bad_input(OSError(28, "No space left on device", "out/model.safetensors"))
    assert not is_bad_input(ValueError("zip() argument 2 is shorter than argument 1"))
    assert not is_bad_input(OSError("a socket closed"))  # no path of the user's
    assert not is_bad_input(KeyError("chosen"))


def test_bad_input_is_one_line_with_the_common_prefix(tmp_path, capsys):
    status, err = call(capsys, "propose", "--campaign", str(tmp_path / "c"))
    said = f"dpo-inv propose: error: {tmp_path / 'c'}: no campaign.json there: start the campaign with "
    assert status == 2 and err == said + "--structure\n"
    status, err = call(capsys, "plot", str(tmp_path))  # a folder without metrics.jsonl: the user's path
    assert status == 2 and err.startswith("dpo-inv plot: error: [Errno 2] No such file or directory: ")
    assert len(err.splitlines()) == 1 and str(tmp_path / "metrics.jsonl") in err


def test_each_bad_record_is_a_line_with_the_common_prefix(tmp_path, capsys):
    rows = group("2xcjA", [1.0, 2.0, 3.0])
    data = write(
        tmp_path / "scored.jsonl", [rows[0], {**rows[1], "score": "n/a"}, {**rows[2], "score": None}]
    )
    status, err = call(capsys, "pairs", str(data), "--output", str(tmp_path / "pairs.jsonl"),
                       "--cache_dir", str(tmp_path / "cache"))  # fmt: skip
    assert status == 2 and "Traceback" not in err, err
    assert err.splitlines() == [
        f"dpo-inv pairs: error: {data}:2: score field 'score' is not a number: 'n/a'; write a number",
        f"dpo-inv pairs: error: {data}:3: missing score field 'score'; add a number to every record or name "
        "it with --score_field",
    ]


def planted(bug: Exception):
    """A `plot` that meets ``bug`` three calls deep, as a mistake in dpo_inv would."""

    def inner() -> None:
        raise bug

    def middle() -> None:
        inner()

    def plot(output_dir: str) -> list[Path]:
        middle()
        return []

    return plot


@pytest.mark.parametrize("bug", ["zip", "ValueError", "IndexError"])
def test_a_planted_bug_is_not_reported_as_bad_input(tmp_path, capsys, monkeypatch, bug):
    if bug == "zip":  # a length mismatch inside dpo_inv: a ValueError, but not the user's
        plot = lambda output_dir: list(zip([1, 2], [1], strict=True))  # noqa: E731
    else:
        plot = planted(
            ValueError("operands could not be broadcast") if bug == "ValueError" else IndexError("3")
        )
    monkeypatch.setattr(dpo_inv.commands.plot, "plot", plot)
    status, err = call(capsys, "plot", str(tmp_path))
    lines = err.strip().splitlines()
    assert status == 1 and lines[0] == "Traceback (most recent call last):", err
    assert lines[-1].startswith("dpo-inv plot: error: a bug in dpo_inv, not in your input: ")
    assert "please report it" in lines[-1] and "--debug" in lines[-1]
    assert len(re.findall(r'^  File "', err, re.MULTILINE)) <= BUG_FRAMES  # short: its last frames
    assert sum(line.startswith("dpo-inv plot: error: ") for line in lines) == 1


def test_debug_prints_a_bugs_whole_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dpo_inv.commands.plot, "plot", planted(ValueError("a shape mismatch")))
    status, err = call(capsys, "plot", str(tmp_path), "--debug")
    frames = re.findall(r'^  File "(.*?)", line \d+, in (\w+)', err, re.MULTILINE)
    assert status == 1 and len(frames) > BUG_FRAMES and frames[0][1] == "run" and frames[-1][1] == "inner"
    assert err.strip().splitlines()[-1].endswith("(all its frames)")
