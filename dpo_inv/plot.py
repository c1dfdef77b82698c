"""`python -m dpo_inv.plot OUTPUT_DIR`: training curves from metrics.jsonl as PNG files (needs matplotlib)."""

from __future__ import annotations

import sys

from dpo_inv.training.plot import plot


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else args
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit("usage: python -m dpo_inv.plot OUTPUT_DIR (the training output_dir with metrics.jsonl)")
    for path in plot(args[0]):
        print(path)


if __name__ == "__main__":
    main()
