"""The `dpo-inv` command: `dpo-inv COMMAND ...` runs `python -m dpo_inv.MODULE ...` (train: dpo_inv.run);
and the argument parsing of the commands that take their input file as an argument."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from transformers import HfArgumentParser

COMMANDS = {
    "train": "dpo_inv.run",
    "score": "dpo_inv.score",
    "plot": "dpo_inv.plot",
    "sample": "dpo_inv.sample",
    "pairs": "dpo_inv.pairs",
    "rounds": "dpo_inv.rounds",
    "adapt": "dpo_inv.adapt",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the command's docstring as written."""


def parse_with_file(
    config_class: type, args: list[str] | None, prog: str, doc: str, metavar: str, what: str
) -> Any:
    """Parse a command's options into ``config_class``, whose `data` field may also be given as the one
    positional argument ``metavar`` (``what`` names it in the error when it is given twice or not at all)."""
    parser = HfArgumentParser(config_class, prog=prog, description=doc, formatter_class=HelpFormatter)
    parser.add_argument("file", nargs="?", metavar=metavar, help=f"The {what}.")
    config, *extra, remaining = parser.parse_args_into_dataclasses(args, return_remaining_strings=True)
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    file = extra[0].file if extra else None
    if (file is None) == (config.data is None):
        parser.error(f"give the {what} file once: {metavar} or --data")
    config.data = config.data or file
    return config


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: dpo-inv {{{','.join(COMMANDS)}}} [options]; see dpo-inv COMMAND --help")
    module = __import__(COMMANDS[sys.argv[1]], fromlist=["main"])
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
