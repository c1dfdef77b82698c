"""The options every command that runs a model shares, declared once (where it runs, the decoding orders),
the sign check of options, and how an option's former name is still taken."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

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


@dataclass(kw_only=True)
class DecodingOrderOptions:
    """The order a model decodes in while it trains or samples (train, rounds, sample)."""

    decoding_order: Literal["random", "left_to_right"] = field(
        default="random",
        metadata={
            "help": "random (fixed positions first, then the designed ones in a seeded random order: per "
            "example in training, per sample when sampling, as ProteinMPNN) or left_to_right. Random by "
            "default because ProteinMPNN learnt over random orders and samples differ by theirs; scoring "
            "(score, scan, adapt) has its own decoding_order, a fixed order where adapt fits a model."
        },
    )


@dataclass(kw_only=True)
class ScoringOrderOptions:
    """The order of the residues a score conditions on (score, scan, adapt)."""

    decoding_order: Literal["random", "left_to_right"] | None = field(
        default=None,
        metadata={
            "help": "The order of the residues a score conditions on (with variants: of those other than the "
            "substituted ones): random (seeded per record from --seed, as training draws it) or "
            "left_to_right. Default: with --ridge the order it was fitted on; score and scan otherwise "
            "random, so their numbers equal training's evaluation; adapt left_to_right, one fixed order "
            "for every fold, which the ridge it writes records. Training and sampling have their own "
            "decoding_order, random by default."
        },
    )

    def scoring_order(self, fitted: str | None = None, fallback: str = "random") -> str:
        """The order given, else the one ``fitted`` (a ridge's), else ``fallback``."""
        return self.decoding_order or fitted or fallback


def take_renamed(config: Any, renamed: Mapping[str, str], command: str) -> None:
    """Move the value of each former option name given (not None) in ``renamed`` (former: new) to its new
    name, with a deprecation line on stderr; both names given different values is bad input."""
    defaults = {spec.name: spec.default for spec in fields(config)}
    for old, new in renamed.items():
        value = getattr(config, old)
        if value is None:
            continue
        setattr(config, old, None)
        current = getattr(config, new)
        if current not in (defaults[new], MISSING, value):
            raise OptionError(
                f"--{old} {value} and --{new} {current}: give --{new} alone ({old} is its former name)"
            )
        said = f"{command}: warning: --{old} is deprecated: it is now --{new} (the same option)"
        print(said, file=sys.stderr, flush=True)
        setattr(config, new, value)


def former_name() -> Any:
    """The field of an option's former name: still taken (a config file's key, on the command line, a
    keyword in Python), hidden from --help; `take_renamed` moves its value to the new name."""
    return field(default=None, metadata={"help": argparse.SUPPRESS})


def check_signs(config: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Refuse a number of the wrong sign (or NaN) among the named options; None passes (not set)."""
    for names, rule in ((positive, "> 0"), (non_negative, ">= 0")):
        for name in names:
            value = getattr(config, name)
            for number in value if isinstance(value, list) else [value]:
                if number is not None and not (number > 0 if rule == "> 0" else number >= 0):
                    raise OptionError(f"{name} must be {rule}, got {value}")
