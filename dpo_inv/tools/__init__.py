"""The tools around a trained model: scoring, sampling, pairing, targets, rewards, on-policy rounds and
few-shot adaptation. Imports dpo_inv.structures, dpo_inv.data, dpo_inv.models and dpo_inv.training only."""
