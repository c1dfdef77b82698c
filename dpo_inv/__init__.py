"""dpo_inv: align ProteinMPNN to preference pairs with Direct Preference Optimization."""

__version__ = "0.1.0"
