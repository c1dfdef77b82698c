"""Training: config, losses, objective, checkpoints, stopping, evaluation, data loading, launch, the loop.
Imports dpo_inv.structures, dpo_inv.data and dpo_inv.models only."""
