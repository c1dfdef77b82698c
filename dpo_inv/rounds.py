"""`python -m dpo_inv.rounds --config FILE.yaml`: on-policy rounds (also `dpo-inv rounds`).

Each round samples `num_samples` sequences per target from the current policy, scores them with the user's
reward, pairs them (or labels them, for kto) and trains on them with the training loop of `dpo_inv.run`;
a last sampling pass scores the final model. Under `output_dir`:

    round-K/samples.jsonl   every sample of round K with its reward
    round-K/pairs.jsonl     its pairs (labels.jsonl for kto); beside them the round's training run:
                            config.yaml, metrics.jsonl, checkpoints/, final/ (the model after round K)
    rounds.jsonl            one line per sampling pass: rewards, recovery, diversity, pairs, seconds
    plots/rounds.png        reward, recovery and diversity by round
"""

from __future__ import annotations

from dpo_inv.tools.rounds import RoundsConfig, check_reward, rounds
from dpo_inv.training.config import EPILOG, command_parser, exit_bad_input, parse_command
from dpo_inv.training.stopping import run_job


def parse_rounds_config(args: list[str] | None = None) -> RoundsConfig:
    """`--config FILE.yaml` plus `--field value` overrides; a bad value exits with status 2 in one line."""
    parser = command_parser(RoundsConfig, "python -m dpo_inv.rounds", __doc__, EPILOG)
    (config,) = parse_command(parser, args)
    try:
        check_reward(config, None)
    except ValueError as err:
        exit_bad_input(parser, str(err))
    return config


def main(args: list[str] | None = None) -> None:
    config = parse_rounds_config(args)
    run_job(lambda: rounds(config), config.debug)


if __name__ == "__main__":
    main()
