"""What a campaign has measured, as variants of its design space: the values to fit on (one per variant),
what failed, what lies outside the space, the lab's rows that match no proposal, and the best so far."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpo_inv.campaign.folder import MeasuredRound
from dpo_inv.data.design import DesignSpace, variant_key
from dpo_inv.data.measurements import Measurement
from dpo_inv.errors import MeasurementError
from dpo_inv.structures.parse import AMINO_ACIDS, tokenize

NAMED = 5  # variants named in a warning line before "and N more"


@dataclass(frozen=True)
class History:
    """Every measured variant once: ``measured [N, L]`` with ``values [N]`` (as written: the lab's
    direction) and the round of each; ``failed [F, L]`` (no value, never measured since); ``keys``: each
    round's rows' variant keys (None where the row lies outside the space)."""

    measured: np.ndarray
    values: np.ndarray
    rounds: np.ndarray
    failed: np.ndarray
    keys: list[list[bytes | None]]
    warnings: list[str]

    def value_of(self, variant: np.ndarray) -> float | None:
        """The measured value of ``variant`` (None: not measured)."""
        found = np.flatnonzero((self.measured == variant).all(1))
        return float(self.values[found[0]]) if len(found) else None

    def best(
        self, space: DesignSpace, lower_is_better: bool, count: int = 10
    ) -> list[tuple[str, float, int]]:
        """The ``count`` best measured variants (mutations, `WT` for the parent; value; round), best first."""
        order = np.argsort(self.values if lower_is_better else -self.values, kind="stable")[:count]
        return [(space.mutations(self.measured[i]) or "WT", float(self.values[i]), int(self.rounds[i]))
                for i in order]  # fmt: skip


def read_history(space: DesignSpace, measured: list[MeasuredRound], listed: bool = False) -> History:
    """The variants of every round's rows; one variant with two values, a round whose file repeats an earlier
    one's rows, or a row that names no variant of the designed chains is bad input; a row of a proposed
    round outside the design space (a position that may not change, an amino acid not allowed, too many
    mutations) is left out of the fit and named in a warning (measurements made before the campaign, a
    scan of the whole protein say, are all fitted on), as are, for the last round, proposals without a
    row and rows that were never proposed. ``listed``: the space is a list of candidates, which
    measurements may leave."""
    seen: dict[bytes, tuple[float, str, int]] = {}
    failed: dict[bytes, np.ndarray] = {}
    tokens_of: dict[bytes, np.ndarray] = {}
    keys, warnings, contents = [], [], []
    for round_ in measured:
        round_keys, outside = [], []
        for row in round_.rows:
            tokens = variant_tokens(space, row)
            key = variant_key(tokens)
            if round_.proposals is not None and not listed and not space.contains(tokens):
                outside.append(row.variant or "WT")
                round_keys.append(None)
                continue
            round_keys.append(key)
            if not np.isfinite(row.value):
                failed.setdefault(key, tokens)
                continue
            if key in seen and seen[key][0] != row.value:
                raise MeasurementError(
                    f"{row.location}: {row.variant or 'the parent'} measured {row.value:g} here and "
                    f"{seen[key][0]:g} at {seen[key][1]}: keep one value per variant (average replicates)"
                )
            seen.setdefault(key, (row.value, row.location, round_.round))
            tokens_of.setdefault(key, tokens)
        content = frozenset(
            (k, r.value) for k, r in zip(round_keys, round_.rows, strict=True) if k is not None
        )
        for earlier, other in contents:
            if content and content <= other:
                raise MeasurementError(
                    f"{round_.path}: its rows repeat those of {earlier} (the same variants and values): "
                    f"write round {round_.round}'s own measurements there"
                )
        contents.append((round_.path, content))
        keys.append(round_keys)
        if outside:
            warnings.append(f"{round_.path}: {_named(outside)} outside the design space: kept in the file, "
                            "left out of the fit")  # fmt: skip
    if measured and measured[-1].proposals is not None:
        warnings += _unmatched(measured[-1], keys[-1])
    length = len(space.parent)
    order = list(seen)
    return History(
        np.array([tokens_of[k] for k in order], dtype=np.int64).reshape(-1, length),
        np.array([seen[k][0] for k in order], dtype=np.float64),
        np.array([seen[k][2] for k in order], dtype=np.int64),
        np.array([t for k, t in failed.items() if k not in seen], dtype=np.int64).reshape(-1, length),
        keys,
        warnings,
    )


def _unmatched(round_: MeasuredRound, keys: list[bytes | None]) -> list[str]:
    """Warnings for the proposals of ``round_`` without a row and its rows that were never proposed."""
    proposed = {variant_key(tokenize(row["sequence"])): row["mutations"] for row in round_.proposals}
    found = set(keys)
    missing = [name or "WT" for key, name in proposed.items() if key not in found]
    extra = [row.variant or "WT" for key, row in zip(keys, round_.rows, strict=True)
             if key is not None and key not in proposed]  # fmt: skip
    warnings = []
    if missing:
        warnings.append(f"{round_.path}: no row for {_named(missing)} of the round's proposals: they may be "
                        "proposed again (a failed measurement: a row with an empty or NA value)")  # fmt: skip
    if extra:
        warnings.append(f"{round_.path}: {_named(extra)} never proposed (controls, or a typo?): taken as "
                        "measured")  # fmt: skip
    return warnings


def _named(variants: list[str]) -> str:
    more = f" and {len(variants) - NAMED} more" if len(variants) > NAMED else ""
    return f"{len(variants)} variant{'s' if len(variants) > 1 else ''} ({', '.join(variants[:NAMED])}{more})"


def variant_tokens(space: DesignSpace, row: Measurement) -> np.ndarray:
    """Tokens of the designed chains of the variant ``row`` names (its mutations or its full sequence)."""
    if row.kind == "mutations":
        return space.parse(row.variant, row.location)
    tokens = tokenize(row.variant.replace("/", "").replace(":", ""))
    if len(tokens) != len(space.parent) or (tokens < 0).any():
        raise MeasurementError(
            f"{row.location}: the sequence has {len(tokens)} residues (or letters outside "
            f"{AMINO_ACIDS}); the designed chains have {len(space.parent)}"
        )
    return tokens
