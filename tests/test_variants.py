"""Conditional variant scoring equals the full-sequence path where it must; Spearman per structure."""

import json

import numpy as np
import pandas
import pytest
import torch
from conftest import EXAMPLE, STABILITY, STRUCTURES, command_in_process, stability_rows

from dpo_inv.data.batches import ExampleDataset, collate, structure_inputs
from dpo_inv.data.dataset import VARIANTS, load_records
from dpo_inv.data.design import read_design_space
from dpo_inv.models.combinations import reordered_passes
from dpo_inv.models.layers import DecLayer
from dpo_inv.models.variants import (
    conditional_deltas,
    conditional_inputs,
    conditional_log_probs,
    conditional_wildtype,
    decoded_last,
    spearman,
    spearman_by_structure,
)
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import parse_structure
from dpo_inv.tools.score import ScoreConfig, score_file


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_passes_that_decode_a_position_last_recompute_only_the_residues_it_reaches(monkeypatch):
    """A pass that decodes a position last differs from the wild type's pass only near that position: the
    states computed from one wild-type pass and the residues each change reaches are the whole passes'
    (float64, the five chains of 1BD2, 815 residues), for a small share of the residues; in fp32 the
    log-probabilities are the whole passes'."""
    model = load_model("vanilla/v_48_020").eval()
    _, example = read_design_space(str(EXAMPLE / "structures" / "1BD2.pdb.gz"), [], None)
    batch = collate([{**example, "wildtype": example["native"]}])
    L, positions = batch["mask"].shape[1], list(range(3, 815, 136))
    computed = []
    update_residues = DecLayer.update_residues

    def counted(layer, h_V, *args):  # noqa: ANN001, ANN202
        computed.append(len(args[-1]) / (L * h_V.shape[2]))
        return update_residues(layer, h_V, *args)

    monkeypatch.setattr(DecLayer, "update_residues", counted)
    with torch.no_grad():
        S, ranks, where = conditional_inputs(batch, positions, 11, 2)
        whole = model.decode(model.encode(**structure_inputs(batch)), S, ranks, positions=where)
        ours = conditional_log_probs(model, batch, positions, 11, 2)
        assert (ours - whole.float().view(len(positions), 2, -1).mean(1)).abs().max() < 1e-4

        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        enc = model.double().encode(**structure_inputs(batch))
        for seed, num_orders in ((None, 1), (11, 2)):
            S, ranks, _ = conditional_inputs(batch, positions, seed, num_orders)
            wildtype = conditional_wildtype(model, enc, batch, seed, num_orders)
            states, _ = decoded_last(model, enc, batch, wildtype, positions, seed, num_orders)
            assert (states.h_V - model.decode_below_last(enc, S, ranks).h_V).abs().max() < 1e-12
        # the joint estimator's passes: three positions moved to the end together, in two orders
        base = conditional_wildtype(model, enc, batch, None, 1)
        ranks = torch.empty(2, L, dtype=torch.long)
        for row, moved in enumerate(([3, 139, 411], [411, 3, 139])):
            ranks[row, [*(j for j in range(L) if j not in moved), *moved]] = torch.arange(L)
        states, _ = reordered_passes(model, enc, base, ranks, torch.zeros(2, dtype=torch.long))
        S = batch["wildtype"].unsqueeze(1).expand(1, 2, L)
        assert (states[-1] - model.decode_below_last(enc, S, ranks[None]).h_V).abs().max() < 1e-12
    assert len(computed) == 8 and max(computed[:6]) < 0.15 and max(computed[6:]) < 0.5  # a few residues


@pytest.mark.parametrize("decoding_order", ["left_to_right", "random"])
def test_conditional_equals_full_sequence_with_the_substitution_decoded_last(tmp_path, decoding_order):
    """With mutable_positions = [the substituted position], the full path decodes that position last after
    all others, in the same order of the others: its delta_logp must equal the conditional one."""
    rows = stability_rows(("2ysf_A_7-40",), 12)
    full = [{**r, "mutable_positions": [r["position"]]} for r in rows]
    common = {"decoding_order": decoding_order, "num_orders": 2, "cache_dir": str(tmp_path / "cache")}
    expected = []
    for i, row in enumerate(full):  # one record per file: the random orders of both paths use its seed
        out = tmp_path / f"full{i}.jsonl"
        score_file(ScoreConfig(data=write(tmp_path / f"v{i}.jsonl", [row]), output=str(out),
                          variant_scoring="full", **common))  # fmt: skip
        expected.append(read(out)[0]["delta_logp"])
        out = tmp_path / f"conditional{i}.jsonl"
        summary = score_file(
            ScoreConfig(data=write(tmp_path / f"c{i}.jsonl", [rows[i]]), output=str(out), **common)
        )
        assert summary["variant_scoring"] == "conditional"
        assert read(out)[0]["delta_logp"] == pytest.approx(expected[-1], abs=1e-4)
    assert len(set(np.round(expected, 3))) > 6  # real, different effects


def test_all_records_of_a_structure_at_once_and_double_mutants_add_up(tmp_path):
    rows = stability_rows(("2ysf_A_7-40", "2ysh_A_4-40"), 30, stride=3)
    data = load_records(write(tmp_path / "v.jsonl", rows), tmp_path / "cache", kind=VARIANTS)
    model = load_model("vanilla/v_48_020").eval()
    dataset = ExampleDataset(data)
    together = conditional_deltas(model, dataset, torch.device("cpu"))
    one_by_one = {}
    for i in range(len(rows)):
        alone = load_records(write(tmp_path / f"{i}.jsonl", [rows[i]]), tmp_path / "cache", kind=VARIANTS)
        one_by_one[i] = conditional_deltas(model, ExampleDataset(alone), torch.device("cpu"))[0]
    assert together == pytest.approx(one_by_one, abs=1e-4)

    # a double mutant scores as the sum of its two single mutants (each decoded last in the wild type)
    first, second = rows[0], next(r for r in rows[1:30] if r["position"] != rows[0]["position"])
    double = list(first["sequence"])
    double[second["position"]] = second["sequence"][second["position"]]
    records = [first, second, {**first, "sequence": "".join(double)},
               {**first, "sequence": first["wildtype_seq"]}]  # fmt: skip
    data = load_records(write(tmp_path / "d.jsonl", records), tmp_path / "cache", kind=VARIANTS)
    deltas = conditional_deltas(model, ExampleDataset(data), torch.device("cpu"))
    assert deltas[2] == pytest.approx(deltas[0] + deltas[1], abs=1e-5)
    assert deltas[3] == 0.0


def test_spearman_per_structure_as_the_field_reports_it(tmp_path):
    domains = ("2ysf_A_7-40", "2ysh_A_4-40", "2op7_A_1-39")
    rows = stability_rows(domains, 40)
    out, table = tmp_path / "scores.jsonl", tmp_path / "per_structure.jsonl"
    config = ScoreConfig(data=write(tmp_path / "v.jsonl", rows), output=str(out),
                         per_structure_output=str(table), cache_dir=str(tmp_path / "cache"))  # fmt: skip
    summary = score_file(config)
    scored = pandas.DataFrame(read(out))
    expected = scored.groupby("domain", sort=False)[["delta_logp", "label"]].corr(method="spearman")
    per_domain = [expected.loc[(d, "delta_logp"), "label"] for d in domains]
    written = read(table)
    assert [w["count"] for w in written] == [40, 40, 40]
    assert [w["spearman"] for w in written] == pytest.approx(per_domain, abs=1e-4)
    assert [(w["pdb_file"], w["chains"]) for w in written] == [(f"{STABILITY}/structures/{d}.pdb.gz", ["A"])
                                                               for d in domains]  # fmt: skip
    assert summary["structures"] == 3 and summary["labelled"] == 120
    assert summary["spearman_per_structure_mean"] == pytest.approx(np.mean(per_domain), abs=1e-4)
    assert summary["spearman_per_structure_median"] == pytest.approx(np.median(per_domain), abs=1e-4)
    pooled = scored[["delta_logp", "label"]].corr(method="spearman").iloc[0, 1]
    assert summary["spearman"] == pytest.approx(pooled, abs=1e-4)
    assert min(per_domain) > 0.2  # the base model ranks stability


def test_spearman_by_structure_leaves_out_what_is_undefined():
    values, labels = np.array([1.0, 2, 3, 1, 2, 5, 5]), np.array([1.0, 2, 3, 3, 2, 1, 2])
    table = spearman_by_structure(values, labels, np.array([0, 0, 0, 1, 1, 2, 2]))
    assert [e["count"] for e in table] == [3, 2, 2]
    assert table[0]["spearman"] == pytest.approx(1.0) and np.isnan(table[1]["spearman"])
    assert np.isnan(spearman(np.array([5.0, 5, 5]), np.array([1.0, 2, 3])))


@pytest.mark.slow
def test_a_substitution_at_a_residue_without_backbone_is_refused(tmp_path):
    native = parse_structure(STRUCTURES / "1mr1D_failing.pdb.gz")["D"].sequence  # residue 2 lacks C and O
    variant = native[:2] + ("A" if native[2] != "A" else "G") + native[3:]
    row = {"pdb_file": str(STRUCTURES / "1mr1D_failing.pdb.gz"), "chain_id": "D", "sequence": variant,
           "wildtype_seq": native, "label": 1.0}  # fmt: skip
    command = ["score", "--data", write(tmp_path / "v.jsonl", [row]), "--output", str(tmp_path / "o.jsonl"),
               "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    result = command_in_process(*command)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "python -m dpo_inv score: error: substitution at position 2 of a residue without backbone "
        f"coordinates (structure {STRUCTURES / '1mr1D_failing.pdb.gz'}); it cannot be scored"
    ]
    full = command_in_process(*command, "--variant_scoring", "full")
    assert full.returncode == 0  # the full path leaves the unobserved residue out of log p
