"""The options every command that runs a model shares, declared once, and the sign check of options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpo_inv.errors import OptionError
from dpo_inv.models.mpnn import ProteinMPNNConfig
from dpo_inv.models.weights import LIGAND_CONTEXT_HELP, LIGAND_EXCLUDE_HELP, parse_options
from dpo_inv.structures.parse import ParseOptions


@dataclass(kw_only=True)
class ModelOptions:
    """The options of every command that runs a model: where, and the context a LigandMPNN model sees."""

    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda, xpu, ...; default: the best available."}
    )
    ligand_context: bool = field(default=True, metadata={"help": LIGAND_CONTEXT_HELP})
    ligand_exclude: list[str] = field(default_factory=list, metadata={"help": LIGAND_EXCLUDE_HELP})

    def parse_options(self, config: ProteinMPNNConfig) -> ParseOptions:
        """How structures are read for a model of ``config`` with these options."""
        return parse_options(config, self.ligand_context, self.ligand_exclude)


def check_signs(config: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Refuse a number of the wrong sign (or NaN) among the named options; None passes (not set)."""
    for names, rule in ((positive, "> 0"), (non_negative, ">= 0")):
        for name in names:
            value = getattr(config, name)
            for number in value if isinstance(value, list) else [value]:
                if number is not None and not (number > 0 if rule == "> 0" else number >= 0):
                    raise OptionError(f"{name} must be {rule}, got {value}")
