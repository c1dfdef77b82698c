"""The pairs command: pairs from scored sequences by each strategy, and its errors; on real data."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas
import pytest
from conftest import EXAMPLE, ROOT, SHARED, command_in_process

from dpo_inv.data.dataset import load_records
from dpo_inv.data.records import DataError
from dpo_inv.tools.pairs import PairsConfig, pairs_file

STABILITY = SHARED / "stability" / "train.jsonl"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def scored_rows() -> list[dict]:
    """One scored record per sequence of the example pairs, structure paths absolute."""
    path = EXAMPLE / "pairs" / "train.jsonl"
    rows = []
    for line in path.read_text().splitlines():
        pair = json.loads(line)
        common = {"pdb_file": str((path.parent / pair["pdb_file"]).resolve()), "chain_id": pair["chain_id"]}
        rows.append({**common, "sequence": pair["preferred_seq"], "score": pair["preferred_score"]})
        rows.append({**common, "sequence": pair["unpreferred_seq"], "score": pair["unpreferred_score"]})
    return rows


def sequences(structure: str) -> tuple[dict, list[str]]:
    """The structure fields and the distinct sequences of one structure of the example data."""
    rows = [r for r in scored_rows() if structure in r["pdb_file"]]
    return {"pdb_file": rows[0]["pdb_file"], "chain_id": rows[0]["chain_id"]}, list(
        dict.fromkeys(r["sequence"] for r in rows)
    )


def group(structure: str, scores: list[float]) -> list[dict]:
    """Hand-made records: the i-th distinct sequence of `structure` with score `scores[i]`."""
    common, seqs = sequences(structure)
    return [{**common, "sequence": seqs[i], "score": s} for i, s in enumerate(scores)]


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path: Path, rows: list[dict], cache: Path, **options) -> tuple[dict, list[dict]]:
    data = write(tmp_path / "in" / "scored.jsonl", rows)
    output = tmp_path / "out" / "pairs.jsonl"
    summary = pairs_file(PairsConfig(output=str(output), data=str(data), cache_dir=str(cache), **options))
    return summary, read(output)


def as_pairs(rows: list[dict], source: list[dict]) -> list[tuple[int, int]]:
    """Each pair as (index of the preferred, index of the unpreferred) sequence in `source`."""
    index = {r["sequence"]: i for i, r in reversed(list(enumerate(source)))}
    return [(index[p["preferred_seq"]], index[p["unpreferred_seq"]]) for p in rows]


def best_vs_worst(rows: list[dict], min_margin: float) -> list[tuple[dict, dict, float]]:
    """The rule, written out: per structure in order, i-th best vs i-th worst after a stable sort."""
    expected = []
    for structure in dict.fromkeys(r["pdb_file"] for r in rows):
        ranked = sorted([r for r in rows if r["pdb_file"] == structure], key=lambda r: -r["score"])
        for i in range(len(ranked) // 2):
            best, worst = ranked[i], ranked[-1 - i]
            margin = best["score"] - worst["score"]
            if margin > 0 and margin >= min_margin:
                expected.append((best, worst, margin))
    return expected


@pytest.mark.parametrize("min_margin", [0.05, 0.15])
def test_best_vs_worst_on_the_example_data(tmp_path, cache, min_margin):
    rows = scored_rows()
    summary, pairs = run(
        tmp_path, rows, cache, strategy="best_vs_worst", score_field="score", min_margin=min_margin
    )
    expected = best_vs_worst(rows, min_margin)
    assert [(p["preferred_seq"], p["unpreferred_seq"], p["preferred_score"], p["unpreferred_score"])
            for p in pairs] == [(b["sequence"], w["sequence"], b["score"], w["score"])
                                for b, w, _ in expected]  # fmt: skip
    assert [p["score_margin"] for p in pairs] == pytest.approx([m for *_, m in expected])
    output = tmp_path / "out" / "pairs.jsonl"
    mean_margin = float(f"{np.mean([m for *_, m in expected]):.4g}")
    assert summary == {"records": 292, "groups": 20, "pairs": len(expected), "merged_duplicates": 0,
                       "mean_margin": mean_margin, "strategy": "best_vs_worst",
                       "output": str(output)}  # fmt: skip
    assert len(expected) == (146 if min_margin == 0.05 else 31)  # 0.15 leaves some out
    first = pairs[0]
    assert first["chain_id"] == "F" and first["pdb_file"] == rows[0]["pdb_file"]  # absolute stays absolute
    assert "wildtype_seq" not in first and "weight" not in first and "mutable_positions" not in first
    assert len(load_records(output, cache).records) == len(pairs)


def test_best_vs_worst_ties_duplicates_and_lower_is_better(tmp_path, cache):
    rows = group("2xcjA", [1.0, 3.0, 3.0, 2.0, 0.0, 2.0])  # A B C D E F: ranked B C D F A E
    rows.append({**rows[1], "score": -5.0})  # B again: merged, keeps 3.0
    summary, pairs = run(tmp_path, rows, cache)
    assert as_pairs(pairs, rows) == [(1, 4), (2, 0)]  # (D, F) tie: no pair
    assert summary["merged_duplicates"] == 1 and summary["records"] == 7 and summary["groups"] == 1
    assert [p["score_margin"] for p in pairs] == [3.0, 2.0]
    _, pairs = run(tmp_path, rows, cache, min_margin=2.5)
    assert as_pairs(pairs, rows) == [(1, 4)]
    _, pairs = run(tmp_path, rows, cache, lower_is_better=True)  # ranked E A D F B C
    assert as_pairs(pairs, rows) == [(4, 2), (0, 1)]
    assert [(p["preferred_score"], p["score_margin"]) for p in pairs] == [(0.0, 3.0), (1.0, 2.0)]


def test_all_with_a_seeded_cap_per_structure(tmp_path, cache):
    first = group("2xcjA", [1.0, 3.0, 3.0, 2.0])  # A B C D: ranked B C D A
    second = group("1lpbA", [0.5, 0.0])
    rows = [first[0], second[0], *first[1:], second[1]]
    _, pairs = run(tmp_path, rows, cache, strategy="all")
    full = [(2, 4), (2, 0), (3, 4), (3, 0), (4, 0), (1, 5)]  # groups in order of first appearance
    assert as_pairs(pairs, rows) == full
    _, pairs = run(tmp_path, rows, cache, strategy="all", min_margin=1.5)
    assert as_pairs(pairs, rows) == [(2, 0), (3, 0)]

    subsets = []
    for seed in range(8):
        _, pairs = run(tmp_path, rows, cache, strategy="all", max_pairs_per_structure=2, seed=seed)
        got = as_pairs(pairs, rows)
        assert got[-1] == (1, 5) and len(got) == 3  # the second group has one pair only
        assert got[:2] == [p for p in full if p in got[:2]]  # a subset, in the strategy's order
        subsets.append(got)
    _, again = run(tmp_path, rows, cache, strategy="all", max_pairs_per_structure=2, seed=0)
    assert as_pairs(again, rows) == subsets[0]
    assert len({tuple(s) for s in subsets}) > 1


def test_top_vs_rest(tmp_path, cache):
    rows = group("2xcjA", [1.0, 3.0, 3.0, 2.0, 0.0])  # A B C D E: ranked B C D A E
    _, pairs = run(tmp_path, rows, cache, strategy="top_vs_rest")
    assert as_pairs(pairs, rows) == [(1, 3), (1, 0), (1, 4)]  # C ties with B: no pair
    _, pairs = run(tmp_path, rows, cache, strategy="top_vs_rest", top_k=2, min_margin=2)
    assert as_pairs(pairs, rows) == [(1, 0), (1, 4), (2, 0), (2, 4)]


def test_csv_gives_the_same_pairs(tmp_path, cache):
    rows = group("2xcjA", [1.0, 3.0, 2.5, 2.0])
    _, expected = run(tmp_path, rows, cache, strategy="all")
    data = tmp_path / "in" / "scored.csv"
    pandas.DataFrame(rows).to_csv(data, index=False)
    output = tmp_path / "out" / "csv.jsonl"
    pairs_file(PairsConfig(output=str(output), data=str(data), strategy="all", cache_dir=str(cache)))
    assert read(output) == expected
    proteinmpnn_names = [{("seq" if k == "sequence" else k): v for k, v in row.items()} for row in rows]
    _, pairs = run(tmp_path, proteinmpnn_names, cache, strategy="all")  # ProteinMPNN's column name
    assert pairs == expected


def stability_rows(count: int = 40) -> list[dict]:
    """The first single mutants of the stability data (positions 0, 1 and 2 of one domain)."""
    rows = [json.loads(line) for line in STABILITY.open().readlines()[:count]]
    return [{**r, "pdb_file": str((STABILITY.parent / r["pdb_file"]).resolve())} for r in rows]


def test_same_position_on_single_mutants(tmp_path, cache, monkeypatch):
    rows = stability_rows()
    summary, pairs = run(tmp_path, rows, cache, strategy="same_position")
    by_position = {}
    for r in rows:
        by_position.setdefault(r["position"], []).append(r["score"])
    expected = sum(a > b for scores in by_position.values() for a in scores for b in scores)
    assert summary["pairs"] == len(pairs) == expected
    index = {r["sequence"]: r for r in rows}
    for p in pairs:
        preferred, unpreferred = index[p["preferred_seq"]], index[p["unpreferred_seq"]]
        assert preferred["position"] == unpreferred["position"] and p["mutable_positions"] == [
            preferred["position"]
        ]
        differ = [
            i for i, (a, b) in enumerate(zip(p["preferred_seq"], p["unpreferred_seq"], strict=True)) if a != b
        ]
        assert differ == p["mutable_positions"] and preferred["score"] > unpreferred["score"]
        assert p["wildtype_seq"] == rows[0]["wildtype_seq"]

    _, with_wildtype = run(tmp_path, rows, cache, strategy="same_position", wildtype_score=0.0)
    wildtype = rows[0]["wildtype_seq"]
    added = [p for p in with_wildtype if wildtype in (p["preferred_seq"], p["unpreferred_seq"])]
    assert len(with_wildtype) == len(pairs) + len(added)
    assert len(added) == sum(r["score"] != 0 for r in rows)
    for p in added:
        mutant = p["unpreferred_seq"] if p["preferred_seq"] == wildtype else p["preferred_seq"]
        assert p["mutable_positions"] == [index[mutant]["position"]]
        assert (p["preferred_seq"] == wildtype) == (index[mutant]["score"] < 0)

    monkeypatch.chdir(tmp_path / "in")  # the trainer reads them, from another working folder
    loaded = load_records(tmp_path / "out" / "pairs.jsonl", cache)
    assert len(loaded.records) == len(with_wildtype)
    assert [int(np.flatnonzero(m)[0]) for m in loaded.records["mutable"]] == [
        p["mutable_positions"][0] for p in with_wildtype
    ]
    assert all(sum(m) == 1 for m in loaded.records["mutable"])


def test_same_position_needs_single_mutants(tmp_path, cache):
    rows = stability_rows(3)
    wildtype = rows[0]["wildtype_seq"]
    rows.append({**rows[0], "sequence": "W" + rows[1]["sequence"][1:-1] + "W"})
    rows.append({**rows[0], "sequence": wildtype})
    rows.append({key: value for key, value in rows[1].items() if key != "wildtype_seq"})
    with pytest.raises(DataError) as err:
        run(tmp_path, rows, cache, strategy="same_position")
    path = tmp_path / "in" / "scored.jsonl"
    assert str(err.value).splitlines() == [
        f"{path}:4: sequence differs from wildtype_seq at 2 positions [0, {len(wildtype) - 1}]; --strategy "
        "same_position needs single mutants: leave the record out or use another strategy",
        f"{path}:5: sequence differs from wildtype_seq at 0 positions []; --strategy same_position needs "
        "single mutants: leave the record out or use another strategy",
        f"{path}:6: missing wildtype_seq, which --strategy same_position needs; add the wild type",
    ]


def test_weight_by_margin_and_residue_scores(tmp_path, cache):
    rows = group("2xcjA", [1.0, 3.0, 2.5, 2.0])
    for i, r in enumerate(rows):
        r["per_residue"] = [i + k / 100 for k in range(len(r["sequence"]))]
    _, pairs = run(
        tmp_path, rows, cache, strategy="all", weight_by_margin=True, residue_score_field="per_residue"
    )
    weights = np.array([p["weight"] for p in pairs])
    margins = np.array([p["score_margin"] for p in pairs])
    assert weights.mean() == pytest.approx(1.0) and weights / margins == pytest.approx(1 / margins.mean())
    index = {r["sequence"]: r for r in rows}
    for p in pairs:
        assert p["preferred_residue_scores"] == index[p["preferred_seq"]]["per_residue"]
        assert p["unpreferred_residue_scores"] == index[p["unpreferred_seq"]]["per_residue"]
    rows[2]["per_residue"] = rows[2]["per_residue"][:-1]
    rows[3]["per_residue"] = [*rows[3]["per_residue"][:-1], math.nan]
    with pytest.raises(DataError) as err:
        run(tmp_path, rows, cache, residue_score_field="per_residue")
    path, n = tmp_path / "in" / "scored.jsonl", len(rows[0]["sequence"])
    assert str(err.value).splitlines() == [
        f"{path}:{line}: per_residue must be a list of {n} finite numbers, one per designed residue, got "
        f"a list of {length}; fix it"
        for line, length in ((3, n - 1), (4, n))
    ]


def test_bad_records_are_reported_together_in_file_order(tmp_path, cache):
    rows = group("2xcjA", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    del rows[1]["score"]
    rows[2]["score"] = "high"
    rows[3]["score"] = math.nan
    rows[4]["score"] = math.inf
    rows[5]["sequence"] = rows[5]["sequence"][:-1]
    rows[6]["score"] = True
    with pytest.raises(DataError) as err:
        run(tmp_path, rows, cache)
    path = tmp_path / "in" / "scored.jsonl"
    assert str(err.value).splitlines() == [
        f"{path}:2: missing score field 'score'; add a number to every record or name it with --score_field",
        f"{path}:3: score field 'score' is not a number: 'high'; write a number",
        f"{path}:4: score field 'score' is nan; give a finite number or leave the record out",
        f"{path}:5: score field 'score' is inf; give a finite number or leave the record out",
        f"{path}:6: sequence has length 83 but designed chains ['A'] of {rows[0]['pdb_file']} have 84 "
        "residues; give one letter per residue of the designed chains, in chain order",
        f"{path}:7: score field 'score' is not a number: True; write a number",
    ]


def command(*args: str) -> subprocess.CompletedProcess:
    return command_in_process("pairs", *args)


@pytest.mark.slow
def test_command_line_errors_exit_2_without_traceback(tmp_path, cache):
    rows = group("2xcjA", [1.0, 2.0])
    data = write(tmp_path / "scored.jsonl", [rows[0], {**rows[1], "score": "n/a"}])
    options = ["--output", str(tmp_path / "pairs.jsonl"), "--cache_dir", str(cache)]
    result = command(str(data), *options)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = "python -m dpo_inv pairs: error: "  # how every error line of the command starts
    assert result.stderr == f"{said}{data}:2: score field 'score' is not a number: 'n/a'; write a number\n"

    data = write(tmp_path / "scored.jsonl", rows)
    result = command(str(data), *options, "--min_margin", "1.5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (
        f"{said}{data}: no pairs: no two sequences of one group differ in score by > 0 and >= --min_margin "
        "1.5 (2 records, 1 groups); give a smaller --min_margin\n"
    )
    assert not (tmp_path / "pairs.jsonl").exists()


@pytest.mark.slow
def test_dpo_inv_pairs_command(tmp_path, cache):
    data = write(tmp_path / "scored.jsonl", group("2xcjA", [1.0, 2.0, 3.0]))
    output = tmp_path / "out" / "pairs.jsonl"
    options = ["--output", str(output), "--strategy", "all", "--cache_dir", str(cache)]
    dpo_inv = str(Path(sys.executable).with_name("dpo-inv"))
    result = subprocess.run([dpo_inv, "pairs", str(data), *options], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary == {"records": 3, "groups": 1, "pairs": 3, "merged_duplicates": 0, "mean_margin": 1.333,
                       "strategy": "all", "output": str(output)}  # fmt: skip
    assert [p["score_margin"] for p in read(output)] == [1.0, 2.0, 1.0]


def test_a_length_that_fits_the_other_model_family_names_it(tmp_path, cache):
    """1hvr chain A: 98 residues as ProteinMPNN reads it, 99 as LigandMPNN does (a modified residue)."""
    rng = np.random.default_rng(0)
    structure = {"pdb_file": str(SHARED / "structures" / "1hvr.pdb.gz"), "chain_id": "A"}
    rows = [{**structure, "sequence": "".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), 99)), "score": s}
            for s in (1.0, 2.0)]  # fmt: skip
    with pytest.raises(DataError) as err:
        run(tmp_path, rows, cache)
    first = str(err.value).splitlines()[0]
    assert first.endswith(
        "have 98 residues; give one letter per residue of the designed chains, in chain order; it fits them "
        "as LigandMPNN models read them: give one, e.g. --model ligand/v_32_010_25"
    )
    summary, pairs = run(tmp_path, rows, cache, model="ligand/v_32_010_25")
    assert summary["pairs"] == 1 and len(pairs[0]["preferred_seq"]) == 99
    rows = [{**row, "sequence": row["sequence"][:97]} for row in rows]  # fits neither: no hint
    with pytest.raises(DataError) as err:
        run(tmp_path, rows, cache)
    assert str(err.value).splitlines()[0].endswith("in chain order")


def test_structure_paths_stay_absolute_or_become_relative_to_the_output(tmp_path, cache):
    (tmp_path / "structures").mkdir()
    (tmp_path / "link").symlink_to(SHARED / "structures")
    absolute = str(tmp_path / "link" / "2xcjA.pdb.gz")  # through a link: kept as written
    (tmp_path / "structures" / "2xcjA.pdb.gz").write_bytes(
        (SHARED / "structures" / "2xcjA.pdb.gz").read_bytes()
    )
    for pdb_file, expected in (
        (absolute, absolute),
        ("../structures/2xcjA.pdb.gz", "../../structures/2xcjA.pdb.gz"),
    ):
        rows = [{**row, "pdb_file": pdb_file} for row in group("2xcjA", [1.0, 2.0])]
        data = write(tmp_path / "in" / "scored.jsonl", rows)
        output = tmp_path / "out" / "deep" / "pairs.jsonl"
        pairs_file(PairsConfig(output=str(output), data=str(data), cache_dir=str(cache)))
        assert [pair["pdb_file"] for pair in read(output)] == [expected]
        assert len(load_records(str(output), str(cache)).records) == 1  # readable where it was written
