"""The ProteinMPNN model family: layers, features, weights, sampling and variant scoring.
Imports dpo_inv.structures and dpo_inv.data only."""
