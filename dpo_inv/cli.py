"""The `dpo-inv` command: `dpo-inv COMMAND ...` runs `python -m dpo_inv.MODULE ...` (train: dpo_inv.run)."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": "dpo_inv.run",
    "score": "dpo_inv.score",
    "plot": "dpo_inv.plot",
    "sample": "dpo_inv.sample",
    "pairs": "dpo_inv.pairs",
    "rounds": "dpo_inv.rounds",
    "adapt": "dpo_inv.adapt",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: dpo-inv {{{','.join(COMMANDS)}}} [options]; see dpo-inv COMMAND --help")
    module = __import__(COMMANDS[sys.argv[1]], fromlist=["main"])
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
