"""The batch rule on a library of few positions: the share of the zero-shot ranking's unmeasured top follows
its record on the campaign's own measurements, and the predictor family is the one cross-validation ranks
best."""

import csv
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
from conftest import EXAMPLE

from dpo_inv.campaign.batch import choose_batch
from dpo_inv.campaign.predictors import FAMILIES, Library, choose_family, out_of_fold, top_value

STRUCTURE = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"


def library(alive: float = 0.03) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every combination of 20 residues at three sites (parent the first), a share ``alive`` of them alive
    (the rest 0), the best 1.0."""
    rng = np.random.default_rng(0)
    tokens = np.array(list(itertools.product(range(20), repeat=3)), dtype=np.uint8)
    values = np.where(rng.uniform(size=len(tokens)) < alive, rng.uniform(size=len(tokens)), 0.0)
    values[rng.integers(len(tokens))] = 1.0
    return tokens, values, tokens[0]


def test_the_zero_shot_top_gets_a_share_of_the_batch_by_its_record():
    """A zero-shot score that is noise but for its top (the 20 best variants, the best first): after 24
    measured at random the zero-shot top has no record, gets a share of the batch as large as the
    predictor's record allows, and the best variant is in the batch. Where its top was measured and came
    back dead, its record says so and its share falls to its rate's against the predictor's (here under a
    fifth)."""
    tokens, values, parent = library()
    rng = np.random.default_rng(1)
    scores = rng.normal(size=len(tokens))
    top = np.argsort(-values)[:20]
    scores[top] = 10 + values[top]
    measured = rng.choice(np.setdiff1d(np.arange(len(tokens)), top), 24, replace=False)
    left = np.setdiff1d(np.arange(len(tokens)), measured)
    choice = choose_batch(tokens[measured], values[measured], scores[measured], tokens[left], scores[left],
                          parent, 24, "thompson", families=("ridge",))  # fmt: skip
    shares = choice.portfolio
    assert shares.zero_shot_record.tried == 0 and shares.zero_shot + shares.predictor == 24
    assert shares.zero_shot > 24 * 0.4 and choice.rules.count("zero_shot") == shares.zero_shot
    assert np.argmax(values) in left[choice.picked]
    dead = np.flatnonzero(values == 0)[:40]  # the zero-shot top is now 40 dead variants, measured
    scores[dead] = 20.0
    measured = np.concatenate([measured, dead])
    left = np.setdiff1d(np.arange(len(tokens)), measured)
    choice = choose_batch(tokens[measured], values[measured], scores[measured], tokens[left], scores[left],
                          parent, 24, "thompson", families=("ridge",))  # fmt: skip
    shares = choice.portfolio
    assert (shares.zero_shot_record.hits, shares.zero_shot_record.tried) == (0, 40)
    rates = shares.zero_shot_record.rate, shares.predictor_record.rate
    assert shares.zero_shot == round(24 * rates[0] / sum(rates)) < 24 / 5


def test_the_predictor_family_is_the_one_cross_validation_ranks_best():
    """Each family is judged by the measured values its out-of-fold predictions put first; the one chosen
    is the best judged. Where the zero-shot score is the value itself, the chosen family's out-of-fold top
    tenth is the measured top tenth."""
    tokens, values, parent = library(alive=0.3)
    measured = np.random.default_rng(2).choice(len(tokens), 96, replace=False)
    noise = np.random.default_rng(3).normal(size=(96, 1))
    data = Library(tokens[measured], values[measured], noise, parent, None)
    chosen = choose_family(data, FAMILIES, 4, 0)
    assert set(chosen.judged) == set(FAMILIES)
    assert chosen.judged[chosen.family] == max(chosen.judged.values())
    assert chosen.judged["trees"] == top_value(out_of_fold("trees", data, 0), data.values)
    assert chosen.predictor.predict(tokens[:5], np.zeros((5, 1))).shape == (4, 5)
    told = Library(tokens[measured], values[measured], values[measured, None], parent, None)
    chosen = choose_family(told, FAMILIES, 4, 0)
    assert chosen.judged[chosen.family] == top_value(values[measured], values[measured])


def test_a_rounds_summary_says_which_predictor_and_where_the_batch_went(tmp_path):
    """A round fitted on 12 measured combinations of two positions: summary.json names the predictor
    family chosen and why, and how many of the batch each rule picked (the zero-shot top's share among
    them), as proposals.csv's picked_by column has them."""
    import dpo_inv

    rng = np.random.default_rng(0)
    pairs = [f"E8{a}:W37{b}" for a in "AVILMFY" for b in "AVILMF"]
    measured = tmp_path / "before.csv"
    measured.write_text("mutations,value\n" + "".join(f"{m},{rng.uniform():.3f}\n" for m in pairs[:12]))
    summary = dpo_inv.propose(tmp_path / "c", "vanilla/v_48_020", structure=str(STRUCTURE), chain_id=["A"],
                              positions="A:8,37", allowed_aas="AVILMFWY", max_mutations=2, num_proposals=8,
                              adapt="no", measurements=str(measured))  # fmt: skip
    assert summary["predictor"].split(" (")[0] in ("predictor ridge", "predictor alive")
    assert "zero-shot ranking's unmeasured top" in summary["picked_by"]
    rows = list(csv.DictReader(Path(summary["proposals"]).read_text().splitlines()))
    assert summary["batch"] == dict(Counter(row["picked_by"] for row in rows))
    assert sum(summary["batch"].values()) == 8
    assert json.loads((tmp_path / "c" / "round_1" / "summary.json").read_text()) == summary
