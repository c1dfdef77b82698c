"""The user's reward for on-policy rounds: a Python function, or a shell command in another environment.

A function, given as `path/to/file.py:function` or `package.module:function`, is called with a list of
records (`pdb_file`, an absolute path; `design_chains`; `fixed_chains`; `sequence`) and returns one float
per record, higher is better. A command reads the same records as JSON lines on stdin and writes one JSON
number per line on stdout. Anything else (an exception, a failing command, the wrong count, a value that
is not a finite number) is a `RewardError` naming the record.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import numbers
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dpo_inv.errors import OptionError, RewardError

RECORD_FIELDS = ("pdb_file", "design_chains", "fixed_chains", "sequence")
RewardFunction = Callable[[list[dict]], list[float]]


@dataclass(kw_only=True)
class RewardOptions:
    """The reward, as rounds (each round's samples) and propose (each round's proposals, instead of the
    lab) take it: one of a function, its name, or a command."""

    reward: str | None = field(
        default=None,
        metadata={
            "help": "path/to/file.py:function or package.module:function, called with a list of records "
            "(pdb_file, design_chains, fixed_chains, sequence) and returning one number per record: the "
            "samples' rewards (rounds), or the proposals' measurements instead of the lab's (propose)."
        },
    )
    reward_command: str | None = field(
        default=None,
        metadata={
            "help": "Instead of reward: a shell command reading the records as JSON lines on stdin, writing "
            "one JSON number per line on stdout."
        },
    )

    def check_reward(self, function: RewardFunction | None = None, required: bool = False) -> bool:
        """Whether a reward is given (a Python ``function``, `reward` or `reward_command`); two of them, or
        none where one is ``required``, is bad input."""
        given = sum(r is not None for r in (function, self.reward, self.reward_command))
        if given > 1 or (required and not given):
            raise OptionError(
                "give either reward (a Python function) or reward_command (a shell command)"
                + (", not both" if given > 1 else "")
            )
        return given == 1


@functools.cache
def load_reward(spec: str) -> RewardFunction:
    """`file.py:function` (relative to the working directory) or `package.module:function`, imported once
    per process, so that what it loads (a structure predictor) stays loaded from round to round."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise RewardError(f"reward {spec!r}: give path/to/file.py:function or package.module:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise RewardError(f"reward {spec!r}: {path} not found")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(
            f"reward {spec!r}: importing {module_name} failed ({type(err).__name__}: {err})"
        ) from err
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward {spec!r}: {module_name} has no function {name}")
    return function


def _describe(records: list[dict], index: int) -> str:
    record = records[index]
    return f"record {index + 1} ({Path(record['pdb_file']).name}, sequence {record['sequence'][:12]}...)"


def _run_command(command: str, records: list[dict]) -> list:
    lines = "".join(json.dumps(r) + "\n" for r in records)
    result = subprocess.run(command, shell=True, input=lines, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output on stderr"])[-1]
        raise RewardError(f"reward_command exited with status {result.returncode}: {last}")
    values = []
    for number, line in enumerate(result.stdout.splitlines(), start=1):
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError:
            raise RewardError(
                f"reward_command wrote line {number} that is not a JSON number: {line[:40]!r}"
            ) from None
    return values


def compute_rewards(
    records: list[dict], reward: str | RewardFunction | None, command: str | None
) -> list[float]:
    """One finite reward per record, from the function `reward` (or its `file.py:function` name) or the
    shell `command`."""
    inputs = [{name: record[name] for name in RECORD_FIELDS} for record in records]
    if command:
        values, source = _run_command(command, inputs), "reward_command"
    else:
        function = reward if callable(reward) else load_reward(reward)
        source = f"reward {getattr(reward, '__name__', reward)}"
        try:
            values = function(inputs)
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(f"{source} raised {type(err).__name__}: {err}") from err
    if not isinstance(values, (list, tuple)) and hasattr(values, "tolist"):
        values = values.tolist()  # a NumPy array or a tensor
    if not isinstance(values, (list, tuple)) or len(values) != len(records):
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(
            f"{source} returned {count} values for {len(records)} records; return one per record"
        )
    rewards = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"{source} gave {value!r} for {_describe(records, index)}: need a finite number"
            )
        rewards.append(float(value))
    return rewards
