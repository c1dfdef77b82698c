"""Membrane labels for the membrane-label ProteinMPNN models, from a record's optional fields.

The fields and their meaning are LigandMPNN's options: `transmembrane_buried` and `transmembrane_interface`
list residues (chain and author number, e.g. "A12" or "B52A"; a list or a space-separated string) for the
per-residue model, `global_transmembrane_label` (1 transmembrane, 0 soluble) labels every residue for the
global model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpo_inv.errors import DataError

INTERFACE, BURIED = 1, 2


def _residues(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise DataError(f'{name} must list residues as chain + number, e.g. "A12 A13 B52A", got {value!r}')
    return items


def membrane_labels(data: dict, residue_ids: Sequence[str]) -> list[int]:
    """Per-residue labels (0 none, 1 interface, 2 buried; or the global label everywhere) of a record, in the
    order of `residue_ids`; an empty list when the record has no membrane field."""
    buried = _residues(data.get("transmembrane_buried"), "transmembrane_buried")
    interface = _residues(data.get("transmembrane_interface"), "transmembrane_interface")
    label = data.get("global_transmembrane_label")
    if label is not None:
        if buried or interface:
            raise DataError("give global_transmembrane_label or transmembrane_buried/_interface, not both")
        if isinstance(label, bool) or label not in (0, 1, "0", "1"):
            raise DataError(
                f"global_transmembrane_label must be 1 (transmembrane) or 0 (soluble), got {label!r}"
            )
        return [int(label)] * len(residue_ids)
    if not buried and not interface:
        return []
    known = set(residue_ids)
    for name, items in (("transmembrane_buried", buried), ("transmembrane_interface", interface)):
        unknown = [item for item in items if item not in known]
        if unknown:
            raise DataError(
                f"{name} names residues not in the record's chains: {' '.join(unknown[:5])}; write chain + "
                "author residue number, e.g. A12"
            )
    both = sorted(set(buried) & set(interface))
    if both:
        raise DataError(f"residues both buried and interface: {' '.join(both[:5])}; give each one label")
    labels = dict.fromkeys(interface, INTERFACE) | dict.fromkeys(buried, BURIED)
    return [labels.get(residue, 0) for residue in residue_ids]
