"""The errors that blame the user's input, below every layer: `BadInput` and its kinds. The command runner
(`dpo_inv.cli`) reports one as one line and exit status 2; any other exception is a bug in dpo_inv.

Each is a `ValueError`, so code that catches `ValueError` (and the Python API's documented `ValueError`)
keeps working. Raise one only for what the user gave (a file, a record, an option, a reward) and can fix;
a check of dpo_inv's own invariants raises a plain exception. The message names what is wrong and the fix.
"""

from __future__ import annotations


class BadInput(ValueError):
    """Input that cannot be used: the message names it, says what is wrong and how to fix it."""


class DataError(BadInput):
    """A data file or its records: a line per bad record (`FILE:LINE: what is wrong; the fix`). In a launch
    of several processes every rank stops on it together (rank 0 raises it, the others stop with it)."""


class MeasurementError(DataError):
    """A campaign's measurements: the file of a round, its rows or its values."""


class StructureError(BadInput):
    """A structure file that cannot be used, with the file named in the message."""


class RewardError(BadInput):
    """The reward could not be computed or gave an unusable answer; the message says for which record."""


class OptionError(BadInput):
    """An option's value, or options that do not go together (a model or folder that an option names too)."""
