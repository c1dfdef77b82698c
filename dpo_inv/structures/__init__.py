"""Reading structures (PDB, mmCIF) and what a record says about them: chains, ligand context, membrane labels.
Imports no other part of dpo_inv."""
