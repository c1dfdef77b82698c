"""One module per command of `dpo-inv COMMAND`, `python -m dpo_inv COMMAND` (and, for training, `python -m
dpo_inv.run`, which launchers start): its `--help` text, its options, what it runs. Here: the commands with
a line each and `main`, which lists them, says the version and names the closest command to a mistyped one
without importing torch; `dpo_inv.cli` parses and runs a command."""

from __future__ import annotations

import difflib
import sys

from dpo_inv import __version__
from dpo_inv.training.exits import EXIT_BAD_INPUT

COMMANDS = {
    "train": "align a model to preference pairs, labels or per-residue scores (DPO, KTO, ResiDPO, SFT)",
    "score": "log-probabilities of pairs, sequences or variants under a model; Spearman with your labels",
    "scan": "every single substitution of a structure scored: scan.csv, heatmap.png, position sensitivity",
    "sample": "design sequences for backbone structures",
    "pairs": "scored sequences to preference pairs, or to labels for KTO",
    "rounds": "on-policy rounds: sample, score with your reward, pair, train, again",
    "adapt": "adapt a model to a few dozen to a few hundred measured variants of one protein",
    "propose": "a design campaign's next batch of variants to make, from every measurement so far",
    "plot": "a training run's curves, or a campaign's picture, as PNG files",
    "merge": "a LoRA adapter folder merged into its base model: a full model, ProteinMPNN's .pt too",
}


def overview(prog: str) -> str:
    """The top-level help: a line per command."""
    width = max(map(len, COMMANDS))
    lines = "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())
    return (
        f"usage: {prog} COMMAND [options]    ({prog} COMMAND --help: the command's options)\n\n"
        "Align ProteinMPNN and LigandMPNN to your preferences and measurements, and design with them.\n\n"
        f"commands:\n{lines}\n\n"
        "options:\n  -h, --help  print this and exit\n  --version   print the version and exit\n\n"
        "Training also runs as `python -m dpo_inv.run`, the module launchers start. Docs: README.md, docs/.\n"
    )


def main(args: list[str] | None = None, prog: str = "dpo-inv") -> None:
    """`dpo-inv COMMAND [options]`."""
    args = list(sys.argv[1:] if args is None else args)
    first = args[0] if args else None
    if first in ("-h", "--help"):
        print(overview(prog), end="")
        sys.exit(0)
    if first == "--version":
        print(f"dpo_inv {__version__}")
        sys.exit(0)
    if first not in COMMANDS:
        closest = difflib.get_close_matches(first or "", list(COMMANDS), 1)
        problem = f"unknown command {first!r}" if first else "no command given"
        hint = f" (did you mean {closest[0]}?)" if closest else f"; choose from {', '.join(COMMANDS)}"
        sys.stderr.write(f"{overview(prog)}\n{prog}: error: {problem}{hint}\n")
        sys.exit(EXIT_BAD_INPUT)
    from dpo_inv.cli import run  # torch and the rest, only to run a command

    run(first, args[1:], prog)
