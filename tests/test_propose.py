"""Design campaigns: the joint estimator against the decoder itself, `dpo_inv.propose` round after round on
real measurements (stability of a small domain), and its bad input."""

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EXAMPLE, ROOT, command_in_process

from dpo_inv.campaign import exploring
from dpo_inv.campaign.acquisition import (
    fit_ensemble,
    nearness,
    shared_features,
    zero_shot_batch,
)
from dpo_inv.campaign.batch import choose_batch
from dpo_inv.campaign.config import NOISE_LEVELS, ProposeConfig
from dpo_inv.campaign.propose import settle_campaign
from dpo_inv.campaign.scoring import example_ca
from dpo_inv.cli import run as run_command
from dpo_inv.data.batches import ExampleDataset, collate, structure_inputs
from dpo_inv.data.dataset import VARIANTS, load_records
from dpo_inv.data.design import read_design_space
from dpo_inv.models.combinations import Slots, joint_deltas, joint_plan, joint_slots, rotations, slot_head
from dpo_inv.models.variants import conditional_deltas, spearman
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET, tokenize
from dpo_inv.tools.adapt import AdaptOptions, train_head, variant_set

STRUCTURE = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"
LABELLED = EXAMPLE / "adapt" / "labelled.jsonl"


@pytest.fixture(scope="module")
def model():
    return load_model("vanilla/v_48_020").eval()


def labelled() -> list[dict]:
    rows = [json.loads(line) for line in LABELLED.read_text().splitlines()]
    return [{**row, "pdb_file": str(STRUCTURE)} for row in rows]


@pytest.mark.slow
def test_joint_equals_conditional_on_singles_and_the_decoder_on_combinations(model):
    """Singles: the conditional estimator. Multi-mutants: log p of the variant minus the wild type's under
    the full decoder, its mutated positions decoded last in each rotation of their order, averaged; and
    not the sum of its singles."""
    singles = labelled()[:12]
    wildtype = singles[0]["wildtype_seq"]
    rng = np.random.default_rng(0)
    combinations = []
    for m in (2, 3, 5):
        sequence = list(wildtype)
        for p in rng.choice(len(wildtype), m, replace=False):
            sequence[p] = "W" if wildtype[p] != "W" else "A"
        combinations.append({**singles[0], "sequence": "".join(sequence)})
    dataset = ExampleDataset(load_records(singles + combinations, kind=VARIANTS))
    additive = conditional_deltas(model, dataset, torch.device("cpu"))
    batch = collate([dataset[0]])
    W = batch["wildtype"][0].numpy()
    V = np.stack([np.asarray(dataset.records[i]["sequence"]) for i in range(len(dataset))])
    plan = joint_plan(W, V, np.arange(len(W)), model.config.vocab_size)
    with torch.no_grad():
        enc = model.encode(**structure_inputs(batch))
        joint = joint_deltas(model, enc, batch["wildtype"][0], plan).numpy()
        slots = joint_slots(model, enc, batch["wildtype"][0], plan)
        from_slots = torch.sparse.mm(plan.changes, slot_head(model, slots).reshape(-1, 1)).squeeze(1).numpy()
    assert joint[: len(singles)] == pytest.approx([additive[i] for i in range(len(singles))], abs=1e-4)
    assert from_slots == pytest.approx(joint, abs=1e-5)
    for i in range(len(singles), len(V)):
        M = np.flatnonzero(V[i] != W)
        expected = []
        for order in rotations(len(M), 4):
            rest = [j for j in range(len(W)) if j not in set(M)]
            ranks = torch.empty(len(W), dtype=torch.long)
            ranks[torch.tensor([*rest, *M[order]])] = torch.arange(len(W))
            with torch.no_grad():
                variant = model.decode(enc, torch.from_numpy(V[i])[None], ranks[None])[0]
                parent = model.decode(enc, torch.from_numpy(W)[None], ranks[None])[0]
            expected.append(float(sum(variant[p, V[i][p]] - parent[p, W[p]] for p in M)))
        assert joint[i] == pytest.approx(np.mean(expected), abs=1e-4)
    assert max(abs(joint[i] - additive[i]) for i in range(len(singles), len(V))) > 0.05


@pytest.mark.slow
def test_adapt_trains_combinations_on_the_joint_score(model):
    """adapt's set of double mutants holds the joint estimator's slots: its scores equal `joint_deltas`,
    and training on labels (the sum of the measured singles' stabilities) moves them toward the labels."""
    doubles = double_mutants(labelled(), 36)
    labels = [row["label"] for row in doubles]
    dataset = ExampleDataset(load_records(doubles, kind=VARIANTS))
    batch = collate([dataset[0]])
    V = np.stack([np.asarray(dataset.records[i]["sequence"]) for i in range(len(dataset))])
    W = batch["wildtype"][0].numpy()
    variants = variant_set(model, batch, V, np.array(labels), None)
    assert isinstance(variants.states, Slots) and (V != W).sum(1).min() == 2
    plan = joint_plan(W, V, np.arange(len(W)), model.config.vocab_size)
    with torch.no_grad():
        joint = joint_deltas(model, model.encode(**structure_inputs(batch)), batch["wildtype"][0], plan)
    assert variants.reference.numpy() == pytest.approx(joint.numpy(), abs=1e-4)
    config = AdaptOptions(decoding_order="left_to_right", max_steps=[30])
    trained, deltas = train_head(model, [variants], [np.ones(len(labels), dtype=bool)], 3e-4, [30], config)
    assert spearman(deltas[30][0], np.array(labels)) > spearman(joint.numpy(), np.array(labels)) + 0.1
    one = variant_set(model, batch, V, np.array(labels), None, max_orders=1)  # as `propose` adapts
    plan = joint_plan(W, V, np.arange(len(W)), model.config.vocab_size, 1)
    with torch.no_grad():
        joint = joint_deltas(model, model.encode(**structure_inputs(batch)), batch["wildtype"][0], plan)
    assert one.reference.numpy() == pytest.approx(joint.numpy(), abs=1e-4)
    assert len(one.states.h_V) < len(variants.states.h_V)


@pytest.mark.slow
def test_propose_adapts_on_measured_combinations_when_asked(tmp_path, model):
    """`adapt="yes"` on 30 measured double mutants (labelled by the sum of their singles' measured
    stabilities): the round adapts (round_1/adapt.json) and scores the candidates with what it kept."""
    import dpo_inv

    doubles = double_mutants(labelled(), 60)
    (tmp_path / "candidates.csv").write_text("sequence\n" + "".join(f"{d['sequence']}\n" for d in doubles))
    (tmp_path / "measured.csv").write_text(
        "sequence,value\n" + "".join(f"{d['sequence']},{d['label']}\n" for d in doubles[:30])
    )
    files = {"candidates": str(tmp_path / "candidates.csv"), "measurements": str(tmp_path / "measured.csv")}
    summary = dpo_inv.propose(tmp_path / "c", model, structure=str(STRUCTURE), chain_id=["A"],
                              num_proposals=8, adapt="yes", **files)  # fmt: skip
    report = json.loads((tmp_path / "c" / "round_1" / "adapt.json").read_text())
    assert report["cv_spearman_start"] is not None and summary["proposed"] == 8
    kept = (tmp_path / "c" / "round_1" / "model").is_dir()
    assert kept == (report["decision"] == "adapted") and ("model adapted" in summary["picked_by"]) == kept


@pytest.mark.slow
def test_score_joint_and_the_ridge_adapt_ships_on_combinations(tmp_path, model):
    """`score --variant_scoring joint` gives singles their conditional score and combinations the joint
    one; adapt on double mutants ships a ridge fitted on joint scores, which `score --ridge` then uses by
    default (and refuses with the conditional estimator)."""
    import dpo_inv

    singles = labelled()
    doubles = double_mutants(singles, 48)
    records = singles[:6] + doubles
    joint = dpo_inv.score(model, records, variant_scoring="joint", decoding_order="left_to_right")
    conditional = dpo_inv.score(model, records, decoding_order="left_to_right")
    assert [r["delta_logp"] for r in joint[:6]] == pytest.approx([r["delta_logp"] for r in conditional[:6]],
                                                                  abs=1e-4)  # fmt: skip
    differences = [a["delta_logp"] - b["delta_logp"] for a, b in zip(joint[6:], conditional[6:], strict=True)]
    assert max(np.abs(differences)) > 0.05
    _, report = dpo_inv.adapt(doubles, model, output_dir=str(tmp_path / "a"), max_steps=[10, 20])
    ridge = json.loads(Path(report["final_ridge"]).read_text())
    assert ridge["variant_scoring"] == "joint" and ridge["decoding_order"] == "left_to_right"
    final = tmp_path / "a" / "final"
    predicted = dpo_inv.score(str(final), doubles, ridge=report["final_ridge"])
    direct = dpo_inv.score(str(final), doubles, variant_scoring="joint", decoding_order="left_to_right")
    assert [r["delta_logp"] for r in predicted] == pytest.approx([r["delta_logp"] for r in direct], abs=1e-5)
    assert all("predicted_label" in r for r in predicted)
    with pytest.raises(ValueError, match="fitted on joint delta_logp"):
        dpo_inv.score(str(final), doubles, ridge=report["final_ridge"], variant_scoring="conditional")


def double_mutants(singles: list[dict], count: int) -> list[dict]:
    """Double mutants of the measured singles at two positions, labelled by the sum of their stabilities."""
    wildtype = singles[0]["wildtype_seq"]
    rng = np.random.default_rng(1)
    doubles, seen = [], set()
    while len(doubles) < count:
        first, second = (singles[i] for i in rng.choice(len(singles), 2, replace=False))
        key = frozenset((first["mutation"], second["mutation"]))
        if first["position"] == second["position"] or key in seen:
            continue
        seen.add(key)
        sequence = list(wildtype)
        for row in (first, second):
            sequence[row["position"]] = row["sequence"][row["position"]]
        doubles.append({**first, "sequence": "".join(sequence), "label": first["label"] + second["label"]})
    return doubles


def propose(*args: str) -> subprocess.CompletedProcess:
    return command_in_process("propose", *args)


@pytest.mark.slow
def test_a_campaign_round_after_round_on_measured_stability(tmp_path):
    """96 measured single mutants (ProteinGym's mutant,DMS_score) start the campaign; round 1 proposes 8
    unmeasured singles at three positions; their measurements (and a control never proposed) bring round
    2, which proposes none already measured. A call before the measurements is refused, round 1 kept."""
    rows = labelled()
    before = tmp_path / "before.csv"
    before.write_text("mutant,DMS_score\n" + "".join(f"{r['mutation']},{r['label']}\n" for r in rows))
    campaign = tmp_path / "campaign"
    start = ("--structure", str(STRUCTURE), "--chain_id", "A", "--positions", "A:8,37,40")
    result = propose(
        "--campaign", str(campaign), *start, "--measurements", str(before), "--num_proposals", "8"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["round"] == 1 and summary["measured"] == 96 and summary["proposed"] == 8
    # how the zero-shot model (on single mutants vanilla/v_48_020) ranks what was measured before the campaign
    import dpo_inv

    assert json.loads((campaign / "campaign.json").read_text())["model"] == ["vanilla/v_48_020"]
    scan = dpo_inv.scan("vanilla/v_48_020", STRUCTURE, decoding_order="left_to_right")
    scanned = {row["mutant"]: row["delta_logp"] for row in scan}
    zero_shot = np.array([scanned[r["mutation"]] for r in rows])
    expected = spearman(zero_shot, np.array([r["label"] for r in rows]))
    assert summary["last_round"]["round"] == 0 and summary["last_round"]["spearman_predicted"] is None
    assert summary["last_round"]["spearman_zero_shot"] == pytest.approx(expected, abs=5e-3)
    lines = (campaign / "round_1" / "proposals.csv").read_text().splitlines()
    header = lines[0].split(",")
    first = dict(zip(header, lines[1].split(","), strict=True))
    assert header[:5] == ["rank", "mutations", "sequence", "predicted", "uncertainty"]
    measured = {r["mutation"] for r in rows}
    proposed = [line.split(",")[1] for line in lines[1:]]
    assert len(proposed) == 8 and not set(proposed) & measured
    assert all(m[1:-1] in ("8", "37", "40") for m in proposed)
    assert float(first["uncertainty"]) > 0 and first["picked_by"] == "thompson"
    assert float(first["zero_shot_delta_logp"]) == pytest.approx(scanned[first["mutations"]], abs=5e-3)
    fasta = (campaign / "round_1" / "proposals.fasta").read_text()
    assert fasta.count(">round1_") == 8
    assert fasta.startswith(f">round1_001 {first['mutations']} predicted={first['predicted']} uncertainty=")
    adaptation = json.loads((campaign / "round_1" / "adapt.json").read_text())
    assert adaptation["decision"] in summary["picked_by"]
    assert (campaign / "round_1" / "model").exists() == (adaptation["decision"] == "adapted")
    again = propose("--campaign", str(campaign))
    assert again.returncode == 2 and "await their measurements" in again.stderr
    assert (campaign / "round_1" / "proposals.csv").read_text().splitlines() == lines
    (campaign / "round_1" / "measurements.csv").write_text(
        "mutations,value\n" + "".join(f"{m},{-0.1 * i}\n" for i, m in enumerate(proposed)) + "WT,0.0\n"
    )
    result = propose("--campaign", str(campaign))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["measured"] == 96 + 8 + 1
    second = [
        line.split(",")[1] for line in (campaign / "round_2" / "proposals.csv").read_text().splitlines()
    ]
    assert len(second) == 9 and not set(second[1:]) & (measured | set(proposed))
    # how round 1's predictions held up: its 8 measured proposals (the control is no proposal)
    predicted = [float(line.split(",")[3]) for line in lines[1:]]
    last = summary["last_round"]
    assert last["round"] == 1 and last["measured"] == 9 and last["best"] == 0.0
    assert last["spearman_predicted"] == pytest.approx(
        spearman(np.array(predicted), -0.1 * np.arange(8)), abs=1e-3
    )
    picture = campaign / "campaign.png"
    assert summary["picture"] == str(picture) and picture.read_bytes()[:4] == b"\x89PNG"
    picture.unlink()
    drawn = command_in_process("plot", str(campaign))
    assert drawn.returncode == 0 and drawn.stdout.strip() == str(picture) and picture.exists(), drawn.stderr


@pytest.mark.parametrize(
    ("options", "measurements", "message"),
    [
        (("--parent", "L8F"), None, "the parent has E at 8, not L"),
        (("--positions", "B:8"), None, "--positions: chain 'B' is not designed"),
        (("--positions", "A:8,9", "--max_mutations", "3"), None, "only 2 positions may change"),
        (("--positions", "A:8", "--num_proposals", "20"), None, "only 19 candidates are left unmeasured"),
        (("--positions", "A:8", "--rounds", "2"), None, "--rounds 2: give --reward or --reward_command"),
        ((), "variant,score\nE8P,1\n", "no a variant column"),
        ((), "mutations,value\nE8P,nan\n", "value must be a finite number"),
        ((), "mutations,value\nE8P,1\nE8P,2\n", "E8P measured 2 here and 1 at"),
        ((), "mutations,value\nK8P,1\n", "the parent has E at 8, not K"),
        (("--model", "vanilla/v_48_020", "ligand/v_32_010_25"), None, "average models of one kind"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, options, measurements, message):
    args = ["--campaign", str(tmp_path / "c"), "--structure", str(STRUCTURE), "--chain_id", "A", *options]
    if measurements is not None:
        (tmp_path / "m.csv").write_text(measurements)
        args += ["--measurements", str(tmp_path / "m.csv")]
    with pytest.raises(SystemExit) as exit_:
        run_command("propose", args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "c").exists()  # nothing written: the call can be given again, mended


def test_a_campaign_started_with_one_model_goes_on_with_it(tmp_path):
    """A campaign.json that names its model as a string (one model) keeps that model."""
    (tmp_path / "campaign.json").write_text(
        json.dumps({"structure": str(STRUCTURE), "model": "vanilla/v_48_010"})
    )
    config = settle_campaign(ProposeConfig(campaign=str(tmp_path)))
    assert config.model == ["vanilla/v_48_010"] and config.structure == str(STRUCTURE)


def test_propose_from_python_with_a_model_object(tmp_path, model):
    """`dpo_inv.propose` in a notebook: the first round of a two-site, two-mutation space, by zero-shot."""
    import dpo_inv

    space = {"positions": "A:8,37", "allowed_aas": "AVILMFWY", "max_mutations": 2}
    summary = dpo_inv.propose(
        tmp_path / "c", model, structure=str(STRUCTURE), chain_id=["A"], num_proposals=5, **space
    )
    lines = (tmp_path / "c" / "round_1" / "proposals.csv").read_text().splitlines()
    assert summary["candidates"] == 8 + 7 + 8 * 7 and len(lines) == 6
    header = (tmp_path / "c" / "round_1" / "proposals.fasta").read_text().splitlines()[0]
    assert header == f">round1_001 {lines[1].split(',')[1]} zero_shot_delta_logp={lines[1].split(',')[5]}"
    picked_by = [line.rsplit(",", 1)[1] for line in lines[1:]]
    assert sorted(picked_by) == ["random"] * 2 + ["zero_shot"] + ["zero_shot_coverage"] * 2
    scores = [float(line.split(",")[5]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True)
    assert json.loads((tmp_path / "c" / "campaign.json").read_text())["max_mutations"] == 2


def test_a_call_reuses_the_zero_shot_scores_kept_by_the_one_before(tmp_path, model, monkeypatch):
    """The first call keeps its candidates' zero-shot scores in the folder; the next reads them instead of
    computing them again and proposes what it proposes with them computed; other weights under the same
    model name, or a damaged file, compute them again."""
    import dpo_inv
    from dpo_inv.campaign import scoring

    space = {"positions": "A:8,37", "allowed_aas": "AVILMFWY", "max_mutations": 2}
    dpo_inv.propose(
        tmp_path / "c", model, structure=str(STRUCTURE), chain_id=["A"], num_proposals=10, **space
    )
    kept = np.load(tmp_path / "c" / "zero_shot.npz")
    assert len(kept["scores"]) == 8 + 7 + 8 * 7 and kept["tokens"].shape == (71, 2)
    lines = (tmp_path / "c" / "round_1" / "proposals.csv").read_text().splitlines()[1:]
    rows = [line.split(",") for line in lines]  # a value from the mutations: the more of them, the better
    measured = "".join(f"{row[1]},{len(row[1])}\n" for row in rows)
    (tmp_path / "c" / "round_1" / "measurements.csv").write_text("mutations,value\n" + measured)
    for copy in ("computed", "other_model", "damaged"):
        shutil.copytree(tmp_path / "c", tmp_path / copy)
    (tmp_path / "computed" / "zero_shot.npz").unlink()
    (tmp_path / "damaged" / "zero_shot.npz").write_bytes(b"PK\x03\x04 cut short")

    computed = []
    original = scoring.zero_shot
    monkeypatch.setattr(
        scoring, "zero_shot", lambda m, e, s, v, *a: computed.append(len(v)) or original(m, e, s, v, *a)
    )
    dpo_inv.propose(tmp_path / "c", model)
    assert computed == []
    for folder in ("computed", "damaged"):
        dpo_inv.propose(tmp_path / folder, model)
        assert computed.pop() == 71
        proposals = (tmp_path / folder / "round_2" / "proposals.csv").read_text()
        assert proposals == (tmp_path / "c" / "round_2" / "proposals.csv").read_text()
    retrained = load_model("vanilla/v_48_010").eval()  # other weights under the campaign's model's name
    retrained.config.name_or_path = model.config.name_or_path
    dpo_inv.propose(tmp_path / "other_model", retrained)
    assert computed == [71]


def test_nearness_carries_a_measured_region_to_positions_never_measured():
    """Singles within 8 Å (Cα) of residue 30 of a real domain are worth 1, the rest 0. Measured: every
    substitution to A at 24 positions. Only with the nearness features does the predictor rank the
    unmeasured positions by their distance to the region (the one-hot and mutated-position features know
    nothing of a position never measured)."""
    space, example = read_design_space(str(STRUCTURE), ["A"])
    ca = example_ca(example, len(space.parent))
    distance = np.linalg.norm(ca - ca[30], axis=1)
    near = nearness(ca, np.array([30, 40]))
    assert near.shape == (len(ca), 2) and near[30, 0] == 0 and near[40, 1] == 0
    assert near[31, 0] == pytest.approx(np.exp(-(distance[31] ** 2) / 200), rel=1e-9)
    parent = space.parent
    alanine = ALPHABET.index("A")
    positions = [p for p in range(len(parent)) if parent[p] != alanine]
    variants = np.repeat(parent[None, :], len(positions), axis=0)
    variants[np.arange(len(positions)), positions] = alanine
    values = (distance[positions] < 8).astype(float)
    measured = np.random.default_rng(0).permutation(len(positions))[:24]
    left = np.setdiff1d(np.arange(len(positions)), measured)
    zero = np.zeros(len(positions))
    for where, better in ((ca, True), (None, False)):
        mean = choose_batch(variants[measured], values[measured], zero[measured], variants[left], zero[left],
                            parent, 4, "greedy", ca=where).mean  # fmt: skip
        rho = spearman(mean, -distance[np.array(positions)[left]])
        assert (rho > 0.5) if better else (np.isnan(rho) or abs(rho) < 0.3), rho


def test_mutations_to_one_residue_inform_that_residue_at_positions_never_measured():
    """Single mutants whose value is set by the residue they mutate to: fitted on 24 of them at 20 positions,
    the ensemble ranks the singles at every other position by that residue, where that residue was measured
    (the features counting the mutations to each residue); without them it cannot tell those singles apart.
    A library of a few positions has its pair features instead."""
    space, _ = read_design_space(str(STRUCTURE), ["A"])
    parent = space.parent
    effects = (0.3, -0.5, 0.8, -0.1, 0.6, -1.0, 0.9)
    effect = {ALPHABET.index(a): v for a, v in zip("ADFKLPW", effects, strict=True)}
    singles = [(p, r) for p in range(len(parent)) for r in effect if parent[p] != r]
    positions, residues = np.array(singles).T
    variants = np.repeat(parent[None, :], len(singles), axis=0)
    variants[np.arange(len(singles)), positions] = residues
    values = np.array([effect[r] for r in residues])
    rng = np.random.default_rng(0)
    at_measured = np.isin(positions, rng.choice(len(parent), 20, replace=False))
    measured = rng.choice(np.flatnonzero(at_measured), 24, replace=False)
    left = np.flatnonzero(~at_measured)
    assert len(np.unique(positions[measured])) > 12  # too many positions for pairs
    zero = np.zeros(len(singles))
    for substituted in (True, False):
        mean = choose_batch(variants[measured], values[measured], zero[measured], variants[left], zero[left],
                            parent, 4, "greedy", substituted=substituted).mean  # fmt: skip
        seen = np.isin(residues[left], residues[measured])  # a residue never measured gets no weight
        rho = spearman(mean[seen], values[left][seen])
        assert (rho > 0.95) if substituted else np.ptp(mean) < 1e-9, rho
    double = parent.copy()
    double[[0, 5]] = ALPHABET.index("W")
    counts = shared_features(np.stack([parent, double]), parent, np.zeros((len(parent), 0)), True)
    assert counts.sum(1).tolist() == [0, 2] and counts[1, ALPHABET.index("W")] == 2
    few = np.flatnonzero(np.isin(positions, np.unique(positions[measured])[:4]))
    assert not fit_ensemble(variants[few], values[few], zero[few, None], parent).substituted
    assert fit_ensemble(variants[measured], values[measured], zero[measured, None], parent).substituted


def test_the_uncertainty_covers_measurements_the_predictor_has_not_seen():
    """Fitted on 48 measured stability singles of a real domain, the predictor's uncertainty (the members'
    spread and the out-of-fold error beyond it) holds about two in three of the other 806 measurements
    within predicted ± uncertainty, and nearly all within twice that; the spread alone holds few."""
    space, example = read_design_space(str(STRUCTURE), ["A"])
    ca = example_ca(example, len(space.parent))
    rows = {name: [json.loads(line) for line in (EXAMPLE / "adapt" / f"{name}.jsonl").open()]
            for name in ("labelled", "candidates")}  # fmt: skip
    tokens = {name: np.array([tokenize(r["sequence"]) for r in rows[name]]) for name in rows}
    labels = {name: np.array([r["label"] for r in rows[name]]) for name in rows}
    measured, left = tokens["labelled"][:48], tokens["candidates"]
    choice = choose_batch(measured, labels["labelled"][:48], np.zeros(48), left, np.zeros(len(left)),
                          space.parent, 8, "thompson", ca=ca)  # fmt: skip
    mean, uncertainty = choice.mean, choice.uncertainty
    ensemble = fit_ensemble(measured, labels["labelled"][:48], np.zeros((48, 1)), space.parent, ca=ca)
    spread = ensemble.predict(left, np.zeros((len(left), 1))).std(0)
    assert ensemble.error > 0
    np.testing.assert_allclose(uncertainty, np.sqrt(spread**2 + ensemble.error**2))
    error = np.abs(labels["candidates"] - mean)
    assert 0.6 < np.mean(error <= uncertainty) < 0.9
    assert np.mean(error <= 2 * uncertainty) > 0.9
    assert np.mean(error <= spread) < 0.35


def test_a_first_batch_covers_the_residues_the_zero_shot_best_leaves_out():
    """Without measurements: three quarters of the batch are the candidates, best first, that hold a residue
    at a position no better-scored candidate holds; the rest is the zero-shot best."""
    parent = np.zeros(3, dtype=int)
    # after 1,1,1 and 2,2,2 the mixed candidates hold no new residue at any position
    mixed = [c for c in itertools.product((1, 2), repeat=3) if len(set(c)) == 2]
    candidates = np.array([(1, 1, 1), (2, 2, 2), *mixed, (3, 3, 3)])
    scores = np.array([10.0, 9.0, *np.linspace(8, 3, len(mixed)), 0.0])
    picked, rules = zero_shot_batch(candidates, scores, parent, 4, at_random=0)
    covering = rules == "zero_shot_coverage"
    assert [tuple(c) for c in candidates[picked[covering]]] == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]
    assert list(picked) == [0, 1, 2, 8]  # best-scored first; the top 4 would leave residue 3 out
    everything, _ = zero_shot_batch(candidates, scores, parent, len(candidates))
    assert sorted(everything) == list(range(len(candidates)))


def test_half_a_first_batch_of_combinations_is_at_random_and_seeded():
    """Half the first batch of a library of combinations is drawn at random, a draw per seed; the rest
    covers the residues by the zero-shot score; on single mutants the batch is the zero-shot best."""
    parent = np.zeros(3, dtype=int)
    candidates = np.array(list(itertools.product(range(5), repeat=3)))[1:]
    scores = -np.arange(len(candidates), dtype=float)
    picked, rules = zero_shot_batch(candidates, scores, parent, 24, seed=1)
    assert (rules == "random").sum() == 12 and len(set(picked)) == 24
    assert list(picked) == sorted(picked)  # best-scored first
    again, _ = zero_shot_batch(candidates, scores, parent, 24, seed=1)
    other, _ = zero_shot_batch(candidates, scores, parent, 24, seed=2)
    assert list(again) == list(picked) and set(other) != set(picked)
    singles = np.array([c for c in candidates if (c != 0).sum() == 1])
    top, rules = zero_shot_batch(singles, -np.arange(len(singles), dtype=float), parent, 6, seed=1)
    assert list(top) == list(range(6)) and "random" not in rules


def test_a_list_of_candidates_is_the_space(tmp_path, model):
    """`candidates`: only the variants of the file are proposed (its duplicates once); a file without a
    variant column is one error naming its columns."""
    import dpo_inv

    listed = ["E8P", "E8A:W37F", "W37Y", "E8P"]
    (tmp_path / "candidates.csv").write_text("mutations,note\n" + "".join(f"{m},x\n" for m in listed))
    summary = dpo_inv.propose(tmp_path / "c", model, structure=str(STRUCTURE), chain_id=["A"],
                              candidates=str(tmp_path / "candidates.csv"), num_proposals=3)  # fmt: skip
    lines = (tmp_path / "c" / "round_1" / "proposals.csv").read_text().splitlines()[1:]
    assert summary["candidates"] == 3 and sorted(line.split(",")[1] for line in lines) == sorted(set(listed))
    (tmp_path / "bad.csv").write_text("name,note\nE8P,x\n")
    with pytest.raises(ValueError, match=r"bad.csv: no variant column .* among its columns \(name, note\)"):
        dpo_inv.propose(tmp_path / "d", model, structure=str(STRUCTURE), chain_id=["A"],
                        candidates=str(tmp_path / "bad.csv"), num_proposals=1)  # fmt: skip


@pytest.mark.slow
def test_a_space_too_large_to_list_is_sampled_from_the_model(tmp_path, model):
    """Any 3 of 40 positions, 8 amino acids each: 3.5 million variants, more than are listed; the round's
    candidates are drawn from the model, each within the space (at most 3 mutations, at those positions,
    of those amino acids), and the batch is 12 distinct ones."""
    import dpo_inv

    space = {"positions": "A:8-47", "allowed_aas": "AVILMFWY", "max_mutations": 3}
    summary = dpo_inv.propose(
        tmp_path / "c", model, structure=str(STRUCTURE), chain_id=["A"], num_proposals=12, **space
    )
    assert 1000 < summary["candidates"] < 128 * 16
    rows = (tmp_path / "c" / "round_1" / "proposals.csv").read_text().splitlines()[1:]
    mutations = [row.split(",")[1].split(":") for row in rows]
    assert len({":".join(m) for m in mutations}) == 12
    for variant in mutations:
        assert 1 <= len(variant) <= 3
        assert all(8 <= int(m[1:-1]) <= 47 and m[-1] in "AVILMFWY" for m in variant)


def test_combinations_are_scored_by_the_four_noise_levels_averaged(tmp_path):
    """A space of combinations, no model given: the campaign's models are the four noise levels, and each
    proposal's zero-shot score is the mean of their joint scores (`score --variant_scoring joint`)."""
    import dpo_inv

    space = {"positions": "A:8,37", "allowed_aas": "AVILMFWY", "max_mutations": 2}
    dpo_inv.propose(tmp_path / "c", structure=str(STRUCTURE), chain_id=["A"], num_proposals=5, **space)
    assert json.loads((tmp_path / "c" / "campaign.json").read_text())["model"] == NOISE_LEVELS
    proposals = (tmp_path / "c" / "round_1" / "proposals.csv").read_text().splitlines()[1:]
    template = labelled()[0]
    records = [{**template, "sequence": line.split(",")[2]} for line in proposals]
    scores = [
        [
            r["delta_logp"]
            for r in dpo_inv.score(name, records, variant_scoring="joint", decoding_order="left_to_right")
        ]
        for name in NOISE_LEVELS
    ]
    assert any(line.split(",")[1].count(":") == 1 for line in proposals)  # double mutants among them
    assert [float(line.split(",")[5]) for line in proposals] == pytest.approx(np.mean(scores, 0), abs=2e-4)


@pytest.mark.slow
def test_rounds_measured_by_a_function_from_python_and_the_shell(tmp_path, model):
    """Labels from a function: measured stability as the oracle over the labelled singles (the
    candidates). From Python, three rounds of 8 from 24 measured before; from the shell, `--reward
    file.py:function --rounds 2`. Each round's measurements are the oracle's values of its proposals; none
    is proposed twice."""
    import dpo_inv

    rows = labelled()
    stability = {row["sequence"]: row["label"] for row in rows}
    (tmp_path / "candidates.csv").write_text("mutations\n" + "".join(f"{r['mutation']}\n" for r in rows))
    (tmp_path / "before.csv").write_text("mutations,value\n" + "".join(f"{r['mutation']},{r['label']}\n"
                                                                        for r in rows[:24]))  # fmt: skip
    start = {"structure": str(STRUCTURE), "chain_id": ["A"], "candidates": str(tmp_path / "candidates.csv"),
             "measurements": str(tmp_path / "before.csv"), "num_proposals": 8}  # fmt: skip

    def oracle(records: list[dict]) -> list[float]:
        return [stability[record["sequence"]] for record in records]

    summaries = dpo_inv.propose(tmp_path / "c", model, reward=oracle, rounds=3, **start)
    assert [s["round"] for s in summaries] == [1, 2, 3] and [s["measured"] for s in summaries] == [24, 32, 40]
    proposed = []
    for n in (1, 2, 3):
        measured = (tmp_path / "c" / f"round_{n}" / "measurements.csv").read_text().splitlines()[1:]
        mutations = [line.split(",")[0] for line in measured]
        labels = {r["mutation"]: r["label"] for r in rows}
        assert [float(line.split(",")[1]) for line in measured] == [labels[m] for m in mutations]
        proposed += mutations
    assert len(set(proposed)) == 24 and not set(proposed) & {r["mutation"] for r in rows[:24]}
    best = [line.split(",") for line in (tmp_path / "c" / "best.csv").read_text().splitlines()[1:]]
    everything = sorted((labels[m] for m in proposed + [r["mutation"] for r in rows[:24]]), reverse=True)
    assert [float(value) for _, value, _ in best] == everything[:10]  # the last round's measurements too
    assert "3" in {n for _, _, n in best}
    picture = tmp_path / "c" / "campaign.png"  # drawn again once the last round is measured
    assert picture.stat().st_mtime >= (tmp_path / "c" / "round_3" / "measurements.csv").stat().st_mtime
    (tmp_path / "oracle.py").write_text(
        "import json\n"
        f"STABILITY = json.load(open({str(tmp_path / 'stability.json')!r}))\n"
        "def measure(records):\n    return [STABILITY[r['sequence']] for r in records]\n"
    )
    (tmp_path / "stability.json").write_text(json.dumps(stability))
    args = ["--campaign", str(tmp_path / "s"), "--structure", str(STRUCTURE), "--chain_id", "A",
            "--candidates", str(tmp_path / "candidates.csv"), "--num_proposals", "4",
            "--reward", f"{tmp_path / 'oracle.py'}:measure", "--rounds", "2"]  # fmt: skip
    result = propose(*args)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["round"] for line in result.stdout.splitlines()] == [1, 2]
    assert len((tmp_path / "s" / "round_2" / "measurements.csv").read_text().splitlines()) == 5


def benchmark(*args: str) -> dict:
    command = [sys.executable, str(ROOT / "scripts" / "campaign_benchmark.py"), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_runs(out: dict, measured: list[int]) -> None:
    """Every method's rounds: fractions in [0, 1], never lower than the round before, and the same first
    round for every method (one draw per seed); how many came back within the predictions' uncertainty,
    for the methods that predict."""
    assert out["measured"] == measured
    assert set(out["methods"]) == {"dpo_inv", "augmented_ridge", "greedy_zero_shot", "random"}
    firsts = set()
    for result in out["methods"].values():
        for key in ("best_fraction", "top1_found"):
            means = [mean for mean, _ in result[key]]
            assert len(means) == len(measured) and all(0 <= m <= 1 for m in means)
            assert means == sorted(means)
        firsts.add(tuple(result["best_fraction"][0]))
    assert len(firsts) == 1
    for method in ("dpo_inv", "augmented_ridge"):  # the methods that predict: each round's batch
        within = out["methods"][method]["within_uncertainty"]
        assert len(within) == len(measured) - 1 and all(0 <= mean <= 1 for mean, _ in within)
    assert not {"within_uncertainty"} & {*out["methods"]["random"], *out["methods"]["greedy_zero_shot"]}


@pytest.mark.slow
def test_the_campaign_benchmark_on_a_landscape_and_on_a_scan(tmp_path):
    """`scripts/campaign_benchmark.py` on a landscape in the layout of `../shared/campaign/trpb` (its 400
    variants whose first two sites are the parent's; the robustness settings' campaigns two at a time) and
    on single-mutant records."""
    trpb = ROOT.parent / "shared" / "campaign" / "trpb"
    landscape = json.loads((trpb / "landscape.json").read_text())
    (tmp_path / "structures").mkdir()
    (tmp_path / "structures" / "5DVZ_A.pdb.gz").symlink_to(trpb / landscape["pdb_file"])
    (tmp_path / "landscape.json").write_text(json.dumps(landscape))
    lines = (trpb / "variants.csv").read_text().splitlines()
    kept = [line for line in lines[1:] if line.startswith(landscape["parent_combination"][:2])]
    (tmp_path / "variants.csv").write_text("\n".join([lines[0], *kept]) + "\n")
    assert len(kept) == 400
    common = ["--rounds", "2", "--seeds", "2", "--cache", str(tmp_path / "cache")]
    out = benchmark("--landscape", str(tmp_path), "--initial", "16", "--batch", "16", *common,
                    "--first_round", "zero_shot")  # fmt: skip
    check_runs(out, [16, 32, 48])
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1  # the zero-shot scores, kept for the next run
    # robustness: two NK landscapes on the same sites, the zero-shot score mixed until its Spearman is 0.3
    command = [sys.executable, str(ROOT / "scripts" / "campaign_benchmark.py"), "--landscape", str(tmp_path),
               "--initial", "16", "--batch", "16", *common, "--synthetic", "1", "--synthetic_count", "2",
               "--prior_spearman", "0.3", "--methods", "dpo_inv", "random", "--jobs", "2"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 proteins, 800 variants" in result.stdout and "Spearman with the values 0.300" in result.stdout
    out = benchmark("--scan", str(EXAMPLE / "adapt" / "labelled.jsonl"), "--score_field", "label",
                    "--initial", "24", "--batch", "8", *common)  # fmt: skip
    check_runs(out, [24, 32, 40])


def trpb_library() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The TrpB four-site landscape of ../shared/campaign/trpb: each combination's residues at the sites (as
    tokens), its fitness, and the backbone's residues there."""
    folder = ROOT.parent / "shared" / "campaign" / "trpb"
    landscape = json.loads((folder / "landscape.json").read_text())
    rows = [line.split(",") for line in (folder / "variants.csv").read_text().splitlines()[1:]]
    tokens = np.array([tokenize(variant) for variant, _ in rows])
    parent = tokenize("".join(landscape["wildtype_seq"][i] for i in landscape["site_indices"]))
    return tokens, np.array([float(value) for _, value in rows]), parent


def test_a_batch_on_a_library_goes_far_from_the_best_too(monkeypatch):
    """A campaign on the TrpB four-site landscape (real fitness, no zero-shot score), 96 at random then
    rounds of 96: each round the highest Thompson draws gather round the best measured, so an eighth of the
    predictor's share of the batch are the highest draws among candidates three or more substitutions from
    each of the ten best (`far`), which the draws alone would leave; another seed, another batch; on single
    mutants the batch is the highest draws alone."""
    tokens, fitness, parent = trpb_library()
    measured = np.random.default_rng(0).choice(len(tokens), 96, replace=False)
    zero = np.zeros(len(tokens))

    def batch(share: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        monkeypatch.setattr(exploring, "FAR_SHARE", share)
        left = np.setdiff1d(np.arange(len(tokens)), measured)
        choice = choose_batch(tokens[measured], fitness[measured], zero[measured], tokens[left], zero[left],
                              parent, 96, "thompson", fit_seed=seed, draw_seed=seed,
                              families=("ridge",))  # fmt: skip
        best = tokens[measured[np.argsort(-fitness[measured])[:10]]]
        far = (tokens[left[choice.picked]][:, None, :] != best[None, :, :]).sum(-1).min(1) >= 3
        rules = np.array(choice.rules)
        return (
            left[choice.picked][rules != "zero_shot"],
            rules[rules != "zero_shot"],
            far[rules != "zero_shot"],
        )

    for round_ in range(2):
        picked, rules, far = batch(0.125, round_)
        eighth = int(0.125 * len(picked))
        assert (rules == "far").sum() == eighth and far[rules == "far"].all()
        alone, rules_alone, far_alone = batch(0.0, round_)
        assert set(rules_alone) == {"thompson"} and far_alone.sum() < eighth <= far.sum()
        assert set(batch(0.125, round_ + 10)[0]) != set(picked)
        measured = np.concatenate([measured, picked])
    singles = np.flatnonzero((tokens != parent).sum(1) == 1)[:60]  # singles at the four sites
    choice = choose_batch(tokens[singles[:20]], fitness[singles[:20]], zero[:20], tokens[singles[20:]],
                          zero[:40], parent, 8, "thompson", pairwise=False)  # fmt: skip
    assert choice.rules == ["thompson"] * 8 and choice.portfolio is None
