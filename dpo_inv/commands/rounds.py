"""`python -m dpo_inv rounds --config FILE.yaml`: on-policy rounds.

Each round samples `num_samples` sequences per target from the current policy, scores them with the user's
reward, pairs them (or labels them, for kto) and trains on them with the training loop of `train`;
a last sampling pass scores the final model. Under `output_dir`:

    round-K/samples.jsonl   every sample of round K with its reward
    round-K/pairs.jsonl     its pairs (labels.jsonl for kto); beside them the round's training run:
                            config.yaml, metrics.jsonl, checkpoints/, final/ (the model after round K)
    rounds.jsonl            one line per sampling pass: rewards, recovery, diversity, pairs, seconds
    plots/rounds.png        reward, recovery and diversity by round
"""

from __future__ import annotations

from dpo_inv.tools.rounds import RoundsConfig, rounds
from dpo_inv.training.config import EPILOG as EPILOG

Config = RoundsConfig


def run(config: RoundsConfig) -> None:
    config.check_reward(required=True)
    rounds(config)
