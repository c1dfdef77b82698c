"""dpo_inv: align ProteinMPNN and LigandMPNN to preferences with Direct Preference Optimization.

The Python API, each function doing what the command beside it does (`python -m dpo_inv COMMAND`, or
`dpo-inv COMMAND`):

    import dpo_inv
    model = dpo_inv.load_model("vanilla/v_48_020")
    scored = dpo_inv.score(model, "data/pairs/val.jsonl")                 # score
    singles = dpo_inv.scan(model, "data/structures/1eteA.pdb.gz")          # scan
    config = dpo_inv.DPOConfig(output_dir="outputs/nb", max_steps=10, report_to="none")
    tuned, metrics = dpo_inv.train(config, train_dataset=dataframe)       # train (python -m dpo_inv.run)
    designs = dpo_inv.sample(tuned, "data/structures/1eteA.pdb.gz")       # sample
    pairs = dpo_inv.make_pairs(scored_designs, strategy="best_vs_worst")  # pairs
    history = dpo_inv.rounds(rounds_config, reward=my_function)           # rounds
    adapted, report = dpo_inv.adapt(my_variants, model)                   # adapt
    summary = dpo_inv.propose("campaigns/my_protein", structure="my.pdb", positions="A:39,40")  # propose

Data may be a file path, a list of dicts, a pandas DataFrame or a `datasets.Dataset`; bad records raise
`DataError` (a `ValueError`), one line per record. See docs/python.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
API = {  # each name of the API and its module, imported on first use: `import dpo_inv` is quick
    "AdaptOutput": "dpo_inv.tools.adapt",
    "DPOConfig": "dpo_inv.training.config",
    "DataError": "dpo_inv.data.records",
    "ProteinMPNN": "dpo_inv.models.mpnn",
    "RoundsConfig": "dpo_inv.tools.rounds",
    "TrainOutput": "dpo_inv.training.trainer",
    "adapt": "dpo_inv.tools.adapt",
    "load_adapters": "dpo_inv.models.weights",
    "load_model": "dpo_inv.models.weights",
    "make_pairs": "dpo_inv.tools.pairs",
    "propose": "dpo_inv.campaign.propose",
    "rounds": "dpo_inv.tools.rounds",
    "sample": "dpo_inv.tools.sample",
    "scan": "dpo_inv.tools.scan",
    "score": "dpo_inv.tools.score",
    "train": "dpo_inv.training.trainer",
}
__all__ = list(API)

if TYPE_CHECKING:
    from dpo_inv.campaign.propose import propose
    from dpo_inv.data.records import DataError
    from dpo_inv.models.mpnn import ProteinMPNN
    from dpo_inv.models.weights import load_adapters, load_model
    from dpo_inv.tools.adapt import AdaptOutput, adapt
    from dpo_inv.tools.pairs import make_pairs
    from dpo_inv.tools.rounds import RoundsConfig, rounds
    from dpo_inv.tools.sample import sample
    from dpo_inv.tools.scan import scan
    from dpo_inv.tools.score import score
    from dpo_inv.training.config import DPOConfig
    from dpo_inv.training.trainer import TrainOutput, train


def __getattr__(name: str):
    """The API's functions and classes, imported when first used."""
    if name not in API:
        raise AttributeError(f"module 'dpo_inv' has no attribute {name!r}")
    value = getattr(importlib.import_module(API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
