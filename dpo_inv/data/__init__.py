"""The data path: record files, the structure cache, the pairs dataset and its batches.
Imports dpo_inv.structures only."""
