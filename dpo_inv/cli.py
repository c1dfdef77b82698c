"""The `dpo-inv` command: `dpo-inv COMMAND ...` runs `python -m dpo_inv.MODULE ...` (train: dpo_inv.run);
and the argument parsing of the commands that take their input file as an argument."""

from __future__ import annotations

import sys
from typing import Any

from dpo_inv.training.config import command_parser, parse_command

COMMANDS = {
    "train": "dpo_inv.run",
    "score": "dpo_inv.score",
    "plot": "dpo_inv.plot",
    "sample": "dpo_inv.sample",
    "pairs": "dpo_inv.pairs",
    "rounds": "dpo_inv.rounds",
    "adapt": "dpo_inv.adapt",
    "propose": "dpo_inv.propose",
}


def parse_with_file(
    config_class: type, args: list[str] | None, prog: str, doc: str, metavar: str, what: str
) -> Any:
    """Parse a command's options into ``config_class``, whose `data` field may also be given as the one
    positional argument ``metavar`` (``what`` names it in the error when it is given twice or not at all)."""
    parser = command_parser(config_class, prog, doc)
    parser.add_argument("file", nargs="?", metavar=metavar, help=f"The {what}.")
    parser.usage = f"%(prog)s {metavar} [--option value ...] (--help: all)"
    config, *extra = parse_command(parser, args)
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
