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

from dpo_inv.campaign.propose import propose
from dpo_inv.data.records import DataError
from dpo_inv.models.mpnn import ProteinMPNN
from dpo_inv.models.weights import load_model
from dpo_inv.tools.adapt import AdaptOutput, adapt
from dpo_inv.tools.pairs import make_pairs
from dpo_inv.tools.rounds import RoundsConfig, rounds
from dpo_inv.tools.sample import sample
from dpo_inv.tools.scan import scan
from dpo_inv.tools.score import score
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.trainer import TrainOutput, train

__version__ = "0.1.0"
__all__ = [
    "AdaptOutput",
    "DPOConfig",
    "DataError",
    "ProteinMPNN",
    "RoundsConfig",
    "TrainOutput",
    "adapt",
    "load_model",
    "make_pairs",
    "propose",
    "rounds",
    "sample",
    "scan",
    "score",
    "train",
]
