"""`python -m dpo_inv.run --config CONFIG.yaml [--field value ...]`: DPO training (also `dpo-inv train`).
The exit statuses are listed by `--help`."""

from __future__ import annotations

import os
import sys
import traceback

from dpo_inv.config import parse_config
from dpo_inv.train import TrainingStopped, train


def main(args: list[str] | None = None) -> None:
    config = parse_config(args)
    try:
        train(config)
    except TrainingStopped as stopped:  # rank 0 has said why and how to resume
        sys.exit(stopped.exit_code)
    except Exception as err:
        # under a launcher the ranks share one output: the rank that failed first names the cause
        traceback.print_exc()
        message = str(err).replace("\n", " | ")
        print(f"rank {os.environ.get('RANK', 0)}: {type(err).__name__}: {message}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
