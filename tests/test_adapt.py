"""Few-shot adaptation (`dpo_inv.adapt`): fold grouping, the ridge baseline, the fast conditional head, the
refusal to ship a worse model, bad input, and short runs end to end on a real stability domain."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, command_in_process, stability_rows

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import VARIANTS, load_records
from dpo_inv.models import variants
from dpo_inv.models.variants import conditional_head, conditional_log_probs, conditional_states, spearman
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.adapt import AdaptOptions, variant_sets
from dpo_inv.tools.folds import assign_folds, variant_groups
from dpo_inv.tools.ridge import AugmentedRidge, augmented_features, fit_ridge, fit_ridge_cv, one_hot

DOMAIN = "2jws_A_7-54"  # 48 residues
QUICK = ("--max_steps", "5", "10", "--num_folds", "3")


def tokens(sequence: str) -> np.ndarray:
    return np.array([ALPHABET.index(c) for c in sequence])


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def domain_rows(count: int, seed: int = 0) -> list[dict]:
    rows = stability_rows((DOMAIN,), per_domain=10_000, stride=1)
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))[:count]]


def run(*args: str) -> subprocess.CompletedProcess:
    return command_in_process("adapt", *args)


def test_folds_keep_every_position_on_one_side_and_near_duplicate_designs_together():
    rows = domain_rows(150)
    variants = [tokens(r["sequence"]) for r in rows]
    wildtypes = [tokens(r["wildtype_seq"]) for r in rows]
    positions = np.array([r["position"] for r in rows])
    folds = assign_folds(variant_groups(variants, wildtypes, [0] * len(rows)), 5, seed=0)
    for k in range(5):
        assert not set(positions[folds == k]) & set(positions[folds != k])
    assert np.bincount(folds).max() - np.bincount(folds).min() <= 6  # balanced by whole positions
    # designs: two near-duplicates (2 differences among their 12 mutated positions) share a group, a
    # distant design does not; double mutants that share one mutation stay apart

    wildtype = wildtypes[0]
    design = wildtype.copy()
    design[:10] = (design[:10] + 1) % 20
    near = design.copy()
    near[20:22] = (near[20:22] + 1) % 20
    far = wildtype.copy()
    far[30:45] = (far[30:45] + 2) % 20
    doubles = [wildtype.copy() for _ in range(2)]
    for double, positions in zip(doubles, ([5, 9], [5, 30]), strict=True):
        double[positions] = (double[positions] + 1) % 20
    groups = variant_groups([design, near, far, *doubles], [wildtype] * 5, [0] * 5)
    assert groups[0] == groups[1] != groups[2] and groups[3] != groups[4]


def test_ridge_matches_the_normal_equations_with_an_unpenalised_score():
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, 20, size=(40, 12))
    score = rng.normal(size=40)
    labels = 2 * score + rng.normal(size=40)
    features = augmented_features(sequences, score)
    assert features.shape == (40, 12 * 21 + 1) and (features[:, :-1].sum(1) == 12).all()
    model = fit_ridge(features, labels, alpha=5.0, unpenalised=1)
    # by hand: intercept and score unpenalised, one-hot penalised by alpha
    X = np.hstack([features, np.ones((40, 1))])
    penalty = np.diag(np.r_[np.full(12 * 21, 5.0), 0.0, 0.0])
    by_hand = np.linalg.lstsq(X.T @ X + penalty, X.T @ labels, rcond=None)[0]
    np.testing.assert_allclose(model.predict(features), X @ by_hand, atol=1e-8)
    # more records than features: the primal form, the same numbers
    small = one_hot(sequences[:, :2])
    X = np.hstack([small, np.ones((40, 1))])
    by_hand = np.linalg.lstsq(X.T @ X + np.diag(np.r_[np.full(42, 5.0), 0.0]), X.T @ labels, rcond=None)[0]
    np.testing.assert_allclose(fit_ridge(small, labels, 5.0).predict(small), X @ by_hand, atol=1e-8)


def test_conditional_head_equals_the_conditional_estimator(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "STATES_PER_PASS", 20)  # the states computed in three passes
    data = load_records(write(tmp_path / "v.jsonl", domain_rows(3)), tmp_path / "cache", kind=VARIANTS)
    batch = collate([ExampleDataset(data)[0]])
    model = load_model("vanilla/v_48_020")
    positions = list(range(48))
    for seed in (None, 7):
        expected = conditional_log_probs(model, batch, positions, seed)
        states = conditional_states(model, batch, positions, seed)
        torch.testing.assert_close(conditional_head(model, states), expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_adapt_end_to_end_writes_a_model_that_score_reads(tmp_path):
    labelled = write(tmp_path / "labelled.jsonl", domain_rows(48))
    rest = write(tmp_path / "rest.jsonl", domain_rows(200, seed=1)[48:])
    result = run(str(labelled), "--output_dir", str(tmp_path / "out"), *QUICK)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "adapt.json").read_text())
    assert report["labelled"] == 48 and report["cv_folds"] == 3
    (structure,) = report["structures"]
    assert structure["labelled"] == 48
    assert {c["max_steps"] for c in report["grid"]} == {5, 10}
    assert report["decision"] == "adapted"  # this domain gains in cross-validation
    assert report["cv_spearman_adapted"] > report["cv_spearman_start"]
    assert "Done: cross-validated Spearman" in result.stdout.splitlines()[-1]
    score = command_in_process("score", "--model", str(tmp_path / "out" / "final"), "--data", str(rest),
                               "--output", str(tmp_path / "scored.jsonl"))  # fmt: skip
    assert score.returncode == 0, score.stderr
    assert json.loads(score.stdout)["spearman_per_structure_mean"] > 0.5
    adapted, base = load_model(tmp_path / "out" / "final"), load_model("vanilla/v_48_020")
    changed = {n for n, p in adapted.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    assert changed and all(n.startswith(("decoder_layers.2.", "W_out.")) for n in changed)
    # a saved model (e.g. outputs/stability/final) is a starting model too
    saved = str(tmp_path / "out" / "final")
    again = run(str(labelled), "--output_dir", str(tmp_path / "again"), "--model", saved, *QUICK)
    assert again.returncode == 0, again.stderr
    stacked = json.loads((tmp_path / "again" / "adapt.json").read_text())
    assert stacked["model"] == saved
    assert stacked["cv_spearman_start"] != report["cv_spearman_start"]


def score_command(tmp_path, *args: str) -> subprocess.CompletedProcess:
    output = str(tmp_path / "scored.jsonl")
    return command_in_process("score", "--output", output, *args)


@pytest.mark.slow
def test_the_augmented_ridge_adapt_ships_is_what_score_applies(tmp_path):
    labelled = write(tmp_path / "labelled.jsonl", domain_rows(40))
    result = run(str(labelled), "--output_dir", str(tmp_path / "out"), *QUICK)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "adapt.json").read_text())
    ridge, final = tmp_path / "out" / "augmented_ridge.json", str(tmp_path / "out" / "final")
    assert report["final_ridge"] == str(ridge) and ridge.is_file()
    assert f"{ridge} (dpo-inv score --ridge)" in result.stdout.splitlines()[-1]
    # score computes the delta_logp the ridge was fitted for (adapt's estimator and order, no option
    # needed): equal to adapt's own scores of the final model; then the ridge on it
    scored = score_command(tmp_path, "--model", final, "--data", str(labelled), "--ridge", str(ridge))
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["spearman_of"] == "predicted_label"
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    model, labels = load_model(final), np.array([r["label"] for r in rows])
    data = load_records(labelled, tmp_path / "cache", kind=VARIANTS)
    (labelled_set,) = variant_sets(model, data, labels, AdaptOptions(), torch.device("cpu"))
    with torch.no_grad():
        adapt_deltas = labelled_set.deltas(model).numpy()
    np.testing.assert_allclose([r["delta_logp"] for r in rows], adapt_deltas, atol=1e-4)
    shipped = AugmentedRidge.load(ridge)
    wildtype, variants = next(iter(shipped.proteins)), np.stack([tokens(r["sequence"]) for r in rows])
    np.testing.assert_allclose(
        [r["predicted_label"] for r in rows], shipped.predict(wildtype, variants, adapt_deltas), atol=1e-3
    )
    # fitted on cross-fitted scores: the adapted model's in-sample scores of its own labels give another fit
    assert report["decision"] == "adapted"
    refitted = fit_ridge_cv(augmented_features(variants, adapt_deltas), labels, 1, seed=42).predict(
        augmented_features(variants, adapt_deltas)
    )
    assert np.abs(np.array([r["predicted_label"] for r in rows]) - refitted).max() > 1e-2
    # lower-is-better labels come back in their own units and direction
    flipped = write(tmp_path / "ddg.jsonl", [{**r, "ddg": -r["label"]} for r in domain_rows(40)])
    result = run(str(flipped), "--output_dir", str(tmp_path / "ddg"), *QUICK, "--score_field", "ddg",
                 "--lower_is_better")  # fmt: skip
    assert result.returncode == 0, result.stderr
    scored = score_command(tmp_path, "--model", str(tmp_path / "ddg" / "final"), "--data", str(flipped),
                           "--ridge", str(tmp_path / "ddg" / "augmented_ridge.json"))  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert spearman(np.array([r["predicted_ddg"] for r in rows]), np.array([r["ddg"] for r in rows])) > 0.5
    # settings that would predict from another score than the one fitted on are refused, a line each
    other = write(tmp_path / "other.jsonl", stability_rows(("1aoy_A_7-75",), per_domain=3))
    for args, expected in [
        (("--model", "vanilla/v_48_020", "--data", str(labelled)), f"give --model {final}"),
        (
            ("--model", final, "--data", str(labelled), "--decoding_order", "random"),
            "--decoding_order left_to",
        ),
        (("--model", final, "--data", str(other)), f"{other}:1: its wild type (69 residues) is not one"),
        (
            ("--model", final, "--data", str(labelled), "--ridge", str(labelled)),
            "not an augmented ridge file",
        ),
    ]:
        result = command_in_process(
            "score", "--output", str(tmp_path / "scored.jsonl"), "--ridge", str(ridge), *args
        )
        code, stderr = result.returncode, result.stderr
        assert code == 2, stderr
        lines = [line for line in stderr.splitlines() if "error:" in line or line.startswith(str(tmp_path))]
        records = 3 if str(other) in args else 1  # a bad record is a line each, another bad input one line
        assert len(lines) == records and expected in lines[0] and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_adapt_keeps_the_starting_model_when_labels_say_nothing(tmp_path):
    rows = domain_rows(40)
    noise = np.random.default_rng(3).permutation([r["label"] for r in rows])
    labelled = write(
        tmp_path / "shuffled.jsonl", [{**r, "label": float(y)} for r, y in zip(rows, noise, strict=True)]
    )
    result = run(str(labelled), "--output_dir", str(tmp_path / "out"), *QUICK, "--min_labels", "20")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "adapt.json").read_text())
    few = run(str(labelled), "--output_dir", str(tmp_path / "few"), *QUICK, "--min_labels", "50")
    assert few.returncode == 0, few.stderr
    assert (
        "fewer than --min_labels 50" in json.loads((tmp_path / "few" / "adapt.json").read_text())["decision"]
    )
    for folder, decision in ((tmp_path / "out", report["decision"]), (tmp_path / "few", "kept")):
        if decision.startswith("kept"):
            kept, base = load_model(folder / "final"), load_model("vanilla/v_48_020")
            for name, value in base.state_dict().items():
                assert torch.equal(kept.state_dict()[name], value), name
    assert report["decision"].startswith("kept the starting model"), report


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, expected",
    [
        ("few", "3 labelled sequences for 5 folds"),
        ("constant", "a constant label ranks nothing"),
        ("nan", "label must be a finite number"),
        ("no_wildtype", "missing wildtype_seq"),
        ("model", "as an official ProteinMPNN checkpoint"),
        ("folds", "--num_folds 1: cross-validation needs at least 2 folds"),
    ],
)
def test_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path, case, expected):
    rows = domain_rows(30)
    model, options = "vanilla/v_48_020", []
    if case == "folds":
        options = ["--num_folds", "1"]
    elif case == "few":
        rows = rows[:3]
    elif case == "constant":
        rows = [{**r, "label": 1.0} for r in rows]
    elif case == "nan":
        rows[4]["label"] = float("nan")
    elif case == "no_wildtype":
        del rows[2]["wildtype_seq"]
    elif case == "model":
        model = str(write(tmp_path / "not_a_model.json", [{"hello": 1}]))
    labelled = write(tmp_path / "labelled.jsonl", rows)
    result = run(str(labelled), "--output_dir", str(tmp_path / "out"), "--model", model, *options)
    assert result.returncode == 2, result.stderr
    said = result.stderr.splitlines()
    lines = [line for line in said if "error: " in line or line.startswith(str(tmp_path))]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    if case in ("few", "constant", "nan", "no_wildtype"):
        assert str(labelled) in lines[0]


@pytest.mark.slow
def test_two_processes_choose_and_train_as_one(tmp_path):
    labelled = write(tmp_path / "labelled.jsonl", domain_rows(30))
    one = run(str(labelled), "--output_dir", str(tmp_path / "one"), *QUICK)
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "dpo_inv", "adapt", str(labelled),
         "--output_dir", str(tmp_path / "two"), *QUICK],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    first, second = (json.loads((tmp_path / d / "adapt.json").read_text()) for d in ("one", "two"))
    assert first["grid"] == second["grid"] and first["decision"] == second["decision"]
    a, b = load_model(tmp_path / "one" / "final"), load_model(tmp_path / "two" / "final")
    for name, value in a.state_dict().items():  # 1 and 2 threads per process: float sums differ
        torch.testing.assert_close(b.state_dict()[name], value, rtol=0, atol=1e-4)
