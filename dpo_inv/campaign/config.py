"""The options of a campaign (`python -m dpo_inv propose`) and what its first call fixes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from dpo_inv.errors import OptionError
from dpo_inv.models.options import ModelOptions, former_name, take_renamed
from dpo_inv.tools.reward_fn import RewardOptions

# ProteinMPNN's four noise levels, the one adapted (the default checkpoint) first
NOISE_LEVELS = ["vanilla/v_48_020", "vanilla/v_48_002", "vanilla/v_48_010", "vanilla/v_48_030"]


@dataclass
class ProposeConfig(ModelOptions, RewardOptions):
    """The options of `python -m dpo_inv propose`, and of `propose` in Python besides the campaign and
    model."""

    campaign: str = field(metadata={"help": "The campaign folder (made by the first call)."})
    structure: str | None = field(default=None, metadata={"help": "PDB/mmCIF file (first call)."})
    chain_id: list[str] = field(default_factory=list, metadata={"help": "Designed chains (default: all)."})
    positions: str = field(
        default="",
        metadata={"help": 'Positions that may change, in ProteinMPNN\'s syntax with author numbers: '
                  '"A:39,40,54" (default: every designed position).'},
    )  # fmt: skip
    allowed_aas: str = field(
        default="",
        metadata={"help": 'Amino acids allowed: "AVILMFWY" everywhere or "39:AVILM 40:FWY" per position '
                  "(default: all 20)."},
    )  # fmt: skip
    max_mutations: int = field(default=1, metadata={"help": "At most this many mutations from the parent."})
    parent: str | None = field(
        default=None, metadata={"help": "Mutations from the structure's sequence to the parent (V39F:D40W)."}
    )
    candidates: str | None = field(
        default=None,
        metadata={"help": "A file of candidate variants (mutations, mutant or sequence) instead of a space."},
    )
    model: list[str] | None = field(
        default=None,
        metadata={"help": "Models (names, .pt files or saved directories) whose joint scores, averaged, are "
                  "the zero-shot score; the first is the one adapted and sampled from (default: "
                  "vanilla/v_48_020 where the candidates are single mutants, ProteinMPNN's four noise levels "
                  "where they combine mutations)."},
    )  # fmt: skip
    measurements: str | None = field(
        default=None, metadata={"help": "Measurements made before the campaign, copied into round_0."}
    )
    score_field: str | None = field(
        default=None,
        metadata={"help": "The measurements' value column, as score, pairs and adapt name theirs (default: "
                  "value or DMS_score)."},
    )  # fmt: skip
    lower_is_better: bool = field(default=False, metadata={"help": "Lower values are better."})
    num_proposals: int = field(
        default=96,
        metadata={"help": "Variants to propose this round: the batch the lab makes and measures."},
    )
    acquisition: str = field(
        default="thompson", metadata={"help": "thompson, ucb (mean + spread) or greedy (mean)."}
    )
    members: int = field(default=10, metadata={"help": "Ensemble members (bootstrap fits)."})
    adapt: Literal["auto", "yes", "no"] = field(
        default="auto",
        metadata={"help": "Adapt the model to the measurements first (dpo-inv adapt's cross-validated DPO; "
                  "the model is kept where that does not rank held-out measurements better): yes, no, or "
                  "auto: where every measured variant is a single mutant (on combinations it costs minutes "
                  "a round)."},
    )  # fmt: skip
    include: str | None = field(
        default=None,
        metadata={"help": "A file of variants of your own choosing (mutations, mutant or sequence) to add to "
                  "this round's batch, proposed as such (picked_by include)."},
    )  # fmt: skip
    rounds: int = field(
        default=1,
        metadata={"help": "Rounds to run, each measured by --reward or --reward_command before the next."},
    )  # fmt: skip
    seed: int = field(
        default=0, metadata={"help": "Seed of the first round, the bootstrap and Thompson draws."}
    )
    # former names, still taken (with a deprecation line): the count was called batch_size, a name that
    # elsewhere (sample, score) means how many are computed together
    value_field: str | None = former_name()
    batch_size: int | None = former_name()
    RENAMED: ClassVar[dict[str, str]] = {"value_field": "score_field", "batch_size": "num_proposals"}

    def __post_init__(self) -> None:
        take_renamed(self, self.RENAMED, "propose")
        self.check_reward()
        if self.acquisition not in ("thompson", "ucb", "greedy"):
            raise OptionError(f"--acquisition {self.acquisition}: give thompson, ucb or greedy")
        for name in ("max_mutations", "num_proposals", "members", "rounds"):
            if getattr(self, name) < 1:
                raise OptionError(f"--{name} {getattr(self, name)}: give a positive number")


# what campaign.json keeps from the first call: the design space and the model (fixed), and the round
# settings (a later call that gives none of these takes the saved ones)
DESIGN_FIELDS = ("structure", "chain_id", "positions", "allowed_aas", "max_mutations", "parent", "candidates",
                 "model", "ligand_context", "ligand_exclude", "score_field", "lower_is_better")  # fmt: skip
ROUND_FIELDS = ("num_proposals", "acquisition", "members", "adapt")
