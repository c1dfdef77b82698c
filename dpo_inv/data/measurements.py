"""Measurements that come back from the lab: a variant and a number per row, in CSV (or any format
`read_records` reads). The variant is `mutations` (`V39F:D40W`), ProteinGym's `mutant`, or the full
`sequence` (ProteinGym's `mutated_sequence`); the number is `value`, ProteinGym's `DMS_score`, or the column
named by ``score_field`` (`propose --score_field`). An empty value or `NA` records a failed measurement (did
not express, no signal): its value is NaN."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

from dpo_inv.data.records import Record, read_records
from dpo_inv.errors import MeasurementError

VARIANT_FIELDS = ("mutations", "mutant", "sequence", "mutated_sequence")
VALUE_FIELDS = ("value", "DMS_score")
FAILED = ("", "NA", "N/A")  # a value written so: the measurement failed


@dataclass(frozen=True)
class Measurement:
    """One measured variant: as written (``kind`` is `mutations` or `sequence`), its value, where it is."""

    variant: str
    kind: str
    value: float
    location: str


def read_measurements(path: str | Path, score_field: str | None = None) -> list[Measurement]:
    """Every row of ``path`` (failed measurements: NaN; rows of empty cells left out); a file without a
    variant or value column, or a row whose value is neither a finite number nor empty or `NA`, is a
    `DataError` naming the file (and the row)."""
    records = read_records(str(path))
    columns = {key for record in records for key in (record.data or {})}
    variant_field = next((f for f in VARIANT_FIELDS if f in columns), None)
    value_fields = (score_field,) if score_field else VALUE_FIELDS
    found_value = next((f for f in value_fields if f in columns), None)
    if variant_field is None or found_value is None:
        missing = "a variant column (" + ", ".join(VARIANT_FIELDS) + ")" if variant_field is None else ""
        if found_value is None:
            missing += (" and " if missing else "") + f"a value column ({', '.join(value_fields)})"
        raise MeasurementError(
            f"{path}: no {missing} among its columns ({', '.join(sorted(columns)) or 'none'}): write "
            "variant,value rows such as mutations,value / V39F:D40W,0.8 (ProteinGym's mutant,DMS_score too)"
        )
    measured, errors = [], []
    for record, written in zip(records, _as_written(path, len(records)), strict=True):
        if written is not None:  # a CSV row: its line and cells as written
            record = replace(record, location=f"{path}:{written[0]}", data=written[1])
        row = record.data or {}
        if _empty(row):
            continue
        value = row.get(found_value)
        if value is None or (isinstance(value, str) and value.strip().upper() in FAILED):
            measured.append(variant_of(record, variant_field, math.nan))
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number):
            errors.append(
                f"{record.location}: {found_value} must be a finite number (empty or NA: the measurement "
                f"failed), got {value!r}"
            )
            continue
        measured.append(variant_of(record, variant_field, number))
    if errors:
        raise MeasurementError(errors[0] + (f" (and {len(errors) - 1} more rows)" if len(errors) > 1 else ""))
    return measured


def _as_written(path: str | Path, rows: int) -> list[tuple[int, dict[str, str]] | None]:
    """A CSV file's rows as written, each with its line number (its reader reads `nan`, `NA` and an empty
    cell all as missing, and skips lines of whitespace, as this does); None for each row of other formats."""
    if Path(path).suffix.lower() != ".csv":
        return [None] * rows
    with open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        return [(reader.line_num, dict(zip(header, cells, strict=False))) for cells in reader
                if len(cells) > 1 or "".join(cells).strip()]  # fmt: skip


def variant_of(record: Record, variant_field: str, value: float) -> Measurement:
    text = (record.data or {}).get(variant_field)
    kind = "sequence" if variant_field in ("sequence", "mutated_sequence") else "mutations"
    return Measurement("" if text is None else str(text), kind, value, record.location)


def read_variants(path: str | Path) -> list[Measurement]:
    """The variants of ``path`` (candidates: a variant column, no value needed; their value is NaN; rows of
    empty cells left out)."""
    records = read_records(str(path))
    columns = {key for record in records for key in (record.data or {})}
    variant_field = next((f for f in VARIANT_FIELDS if f in columns), None)
    if variant_field is None:
        raise MeasurementError(
            f"{path}: no variant column ({', '.join(VARIANT_FIELDS)}) among its columns "
            f"({', '.join(sorted(columns)) or 'none'}): name each candidate, e.g. mutations / V39F:D40W"
        )
    return [
        variant_of(record, variant_field, math.nan) for record in records if not _empty(record.data or {})
    ]


def _empty(row: dict) -> bool:
    """Whether every cell of ``row`` is empty (`,,` in CSV): no variant, no value."""
    return not any(str(cell).strip() for cell in row.values() if cell is not None)
