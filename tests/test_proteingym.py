"""ProteinGym's scan files as they come: `mutant`, `mutated_sequence`, `DMS_score`, the structure stated once
(`--structure`/`--chain_id` or the reference CSV), in `score`, `adapt` and `pairs`, from Python and the
shell; numbering by sequence or by author; a mutant whose wild type does not match is one line."""

import csv
import json

import pytest
from conftest import EXAMPLE, ROOT, command_in_process

import dpo_inv
from dpo_inv.data.proteingym import GivenStructure, complete_records
from dpo_inv.data.records import DataError, Record
from dpo_inv.models.weights import load_model

SHARED = ROOT.parent / "shared" / "function"
SCAN = "CALM1_HUMAN_Weile_2017.csv"
DOMAIN = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"


@pytest.fixture(scope="module")
def model():
    return load_model("vanilla/v_48_020").eval()


def scan_rows(
    count: int, columns: tuple[str, ...] = ("mutant", "mutated_sequence", "DMS_score")
) -> list[dict]:
    """The first ``count`` rows of a shared ProteinGym scan, single and multiple mutants, with ``columns``."""
    with (SHARED / SCAN).open() as handle:
        rows = list(csv.DictReader(handle))
    return [{c: row[c] for c in columns} for row in rows[:count]]


def write_csv(path, rows: list[dict]):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_scan_as_it_comes_scores_as_records_that_name_everything(tmp_path, model):
    structure = SHARED / "structures" / "CALM1_HUMAN_Weile_2017.pdb.gz"
    scan = write_csv(tmp_path / SCAN, scan_rows(24))
    scored = dpo_inv.score(
        model, str(scan), structure=str(structure), chain_id=["A"], score_field="DMS_score"
    )
    assert len(scored) == 24 and {"mutant", "DMS_score", "delta_logp"} <= set(scored[0])
    assert scored.summary["labelled"] == 24 and len(scored.per_structure) == 1
    assert scored.summary["spearman"] == scored.per_structure[0]["spearman"]
    # the same variants written out in full: the same scores
    full = [{"pdb_file": str(structure), "chain_id": "A", "sequence": row["sequence"],
             "wildtype_seq": row["wildtype_seq"]} for row in scored]  # fmt: skip
    assert [r["delta_logp"] for r in dpo_inv.score(model, full)] == [r["delta_logp"] for r in scored]
    assert all(r["wildtype_seq"] == scored[0]["wildtype_seq"] for r in scored)
    # `mutant` alone: the wild type read from the structure gives the same variants
    alone = write_csv(tmp_path / "alone.csv", scan_rows(24, ("mutant", "DMS_score")))
    again = dpo_inv.score(model, str(alone), structure=str(structure), score_field="DMS_score")
    assert [r["sequence"] for r in again] == [r["sequence"] for r in scored]
    assert [r["delta_logp"] for r in again] == [r["delta_logp"] for r in scored]


@pytest.mark.slow
def test_the_reference_csv_names_the_structure_on_the_command_line(tmp_path):
    scan = write_csv(tmp_path / SCAN, scan_rows(24))
    reference = tmp_path / "reference.csv"
    reference.write_text(
        "DMS_id,DMS_filename,pdb_file,chain_id\n"
        f"CALM1,{SCAN},{SHARED / 'structures' / 'CALM1_HUMAN_Weile_2017.pdb.gz'},A\n"
    )
    command = ["score", "--data", str(scan), "--output", str(tmp_path / "o.jsonl"), "--proteingym_reference",
               str(reference), "--score_field", "DMS_score"]  # fmt: skip
    result = command_in_process(*command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["labelled"] == 24 and -1 <= summary["spearman"] <= 1
    # what score writes is a record kind the commands read as it is: every record names its structure
    written = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert all(row["pdb_file"].endswith("CALM1_HUMAN_Weile_2017.pdb.gz") for row in written)
    pairs = command_in_process("pairs", str(tmp_path / "o.jsonl"), "--output", str(tmp_path / "pairs.jsonl"),
                               "--score_field", "DMS_score", cwd=tmp_path)  # fmt: skip
    assert pairs.returncode == 0 and json.loads(pairs.stdout)["pairs"] >= 1, pairs.stderr
    other = tmp_path / "other.csv"
    reference.write_text(f"DMS_filename,pdb_file\n{other.name},x.pdb\n")
    missing = command_in_process(*command, cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr == (
        f"python -m dpo_inv score: error: {reference}: no row with DMS_filename {SCAN}; add one, or give "
        "--structure\n"
    )


def test_author_numbering_and_a_wild_type_that_does_not_match(tmp_path):
    """A domain numbered 1-48 in its file: mutants by sequence index and by author number agree; a wrong
    wild-type letter is one bad record naming the fix."""
    rows = [json.loads(line) for line in (EXAMPLE / "adapt" / "labelled.jsonl").read_text().splitlines()][:5]
    records = [Record(f"scan.csv:{i + 2}", {"mutant": row["mutation"]}) for i, row in enumerate(rows)]
    for numbering in ("sequence", "author"):
        completed = complete_records(records, GivenStructure(str(DOMAIN), ("A",), numbering))
        assert [r.data["sequence"] for r in completed] == [row["sequence"] for row in rows]
        assert {r.data["wildtype_seq"] for r in completed} == {rows[0]["wildtype_seq"]}
        assert completed[0].data["design_chains"] == ["A"]
    wrong = [Record("scan.csv:2", {"mutant": "A8P"})]
    wrong = complete_records(wrong, GivenStructure(str(DOMAIN)))
    assert wrong[0].data is None and wrong[0].error == (
        "mutant 'A8P': the structure has E at 8 (--mutant_numbering sequence), not A; check the structure "
        "and chain, or give --mutant_numbering author"
    )
    with pytest.raises(DataError, match="records record 0: mutant 'A8P': the structure has E at 8"):
        dpo_inv.score("vanilla/v_48_020", [{"mutant": "A8P"}, {"mutant": "E8P"}], structure=str(DOMAIN))


def test_adapt_reads_a_scan_with_its_structure_given_once(tmp_path, model):
    rows = [json.loads(line) for line in (EXAMPLE / "adapt" / "labelled.jsonl").read_text().splitlines()][:30]
    scan = write_csv(
        tmp_path / "scan.csv", [{"mutant": r["mutation"], "DMS_score": r["label"]} for r in rows]
    )
    _, report = dpo_inv.adapt(str(scan), model, output_dir=str(tmp_path / "a"), score_field="DMS_score",
                              structure=str(DOMAIN), max_steps=[5], num_folds=3)  # fmt: skip
    assert report["labelled"] == 30 and report["structures"][0]["pdb_file"] == str(DOMAIN.resolve())
