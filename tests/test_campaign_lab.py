"""A campaign and what the lab sends back: failed measurements, rows missing or never proposed, variants
outside the space, a round's file copied from another, the summary and best.csv each round writes, variants
of one's own choosing (--include), a second call on a running campaign, and the picture."""

import contextlib
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE, command_in_process

from dpo_inv.campaign import propose
from dpo_inv.campaign.config import ProposeConfig
from dpo_inv.campaign.history import read_history
from dpo_inv.campaign.plot import RoundOutcome, plot_campaign
from dpo_inv.campaign.propose import included_variants
from dpo_inv.data.design import read_design_space
from dpo_inv.data.measurements import read_measurements
from dpo_inv.data.records import DataError
from dpo_inv.training.output_lock import lock_folder

STRUCTURE = EXAMPLE / "adapt" / "2jws_A_7-54.pdb.gz"
# E8 and W37 of the domain, to A, V, I, L, M, F, W or Y, one or both: 71 variants; E9 may not change
SPACE = ("--positions", "A:8,37", "--allowed_aas", "AVILMFWY", "--max_mutations", "2")
START = ("--structure", str(STRUCTURE), "--chain_id", "A", *SPACE, "--num_proposals", "5",
         "--model", "vanilla/v_48_020", "--adapt", "no")  # fmt: skip


def call(campaign: Path, *args: str) -> tuple[int, str, str]:
    """`propose --campaign campaign *args`: its exit status, stdout and stderr."""
    result = command_in_process("propose", "--campaign", str(campaign), *args)
    return result.returncode, result.stdout, result.stderr


def start(tmp_path: Path, *args: str) -> Path:
    """A campaign's first round (5 proposals by zero-shot)."""
    campaign = tmp_path / "c"
    code, _, err = call(campaign, *START, *args)
    assert code == 0, err
    return campaign


def proposed(campaign: Path, n: int) -> list[str]:
    """The mutations of round ``n``'s proposals, in rank order."""
    return [row["mutations"] for row in csv.DictReader((campaign / f"round_{n}" / "proposals.csv").open())]


def measure(campaign: Path, n: int, rows: list[tuple[str, str]]) -> None:
    (campaign / f"round_{n}" / "measurements.csv").write_text(
        "mutations,value\n" + "".join(f"{m},{v}\n" for m, v in rows)
    )


def files(campaign: Path) -> dict[str, bytes]:
    """Every file of the campaign folder but the lock (each call writes its name there) and its content."""
    return {str(p.relative_to(campaign)): p.read_bytes() for p in sorted(campaign.rglob("*"))
            if p.is_file() and p.name != "run.lock"}  # fmt: skip


def refused(campaign: Path, message: str, *args: str) -> None:
    """A call that is bad input: one line naming ``message``, exit 2, nothing written."""
    before = files(campaign) if campaign.exists() else None
    code, out, err = call(campaign, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out, err
    assert (files(campaign) if campaign.exists() else None) == before


def warnings(err: str) -> list[str]:
    lines = err.strip().splitlines()
    assert all(line.startswith("propose: warning: ") for line in lines), err
    return lines


def test_a_failed_measurement_is_never_proposed_again(tmp_path):
    """Round 1's first two proposals failed (an empty value, NA): the summary counts them as failed, not
    measured, and neither round 2 nor round 3 proposes them again (they were the zero-shot's favourites)."""
    campaign = start(tmp_path)
    first = proposed(campaign, 1)
    measure(
        campaign, 1, [(first[0], ""), (first[1], "NA"), *((m, f"{0.1 * i}") for i, m in enumerate(first[2:]))]
    )
    code, out, err = call(campaign)
    assert code == 0 and not err, err
    summary = json.loads(out)
    assert summary["failed"] == 2 and summary["measured"] == 3 and summary["last_round"]["measured"] == 3
    second = proposed(campaign, 2)
    assert len(second) == 5 and not set(second) & set(first)
    measure(campaign, 2, [(m, "1.0") for m in second])
    code, out, err = call(campaign)
    assert code == 0 and json.loads(out)["failed"] == 2 and json.loads(out)["measured"] == 8, err
    assert not set(proposed(campaign, 3)) & set(first[:2])


@pytest.mark.parametrize("value", ["abc", "nan", "inf"])
def test_a_value_that_is_no_number_is_bad_input(tmp_path, value):
    campaign = start(tmp_path)
    first = proposed(campaign, 1)
    measure(campaign, 1, [(first[0], "0.5"), (first[1], value), *((m, "0.1") for m in first[2:])])
    refused(campaign, "measurements.csv:3: value must be a finite number")
    assert not (campaign / "round_2").exists()


def test_rows_missing_never_proposed_or_outside_the_space_are_warned_of(tmp_path):
    """Round 1 measured three of its five proposals, a control never proposed, a residue that may not change
    (E9A) and an amino acid not allowed (E8D): one warning line each for the missing proposals, the control,
    and the two outside the space (kept in the file, left out of the fit); the round is still proposed."""
    campaign = start(tmp_path)
    first = proposed(campaign, 1)
    control = next(m for m in ("E8V", "E8L", "E8M", "W37L") if m not in first)
    measure(campaign, 1, [*((m, "0.2") for m in first[:3]), (control, "0.4"), ("E9A", "0.9"), ("E8D", "0.1")])
    written = (campaign / "round_1" / "measurements.csv").read_text()
    code, out, err = call(campaign)
    assert code == 0 and (campaign / "round_2" / "proposals.csv").exists(), err
    outside, missing, extra = warnings(err)
    assert "2 variants (E9A, E8D) outside the design space" in outside
    assert f"no row for 2 variants ({first[3]}, {first[4]}) of the round's proposals" in missing
    assert f"1 variant ({control}) never proposed" in extra
    summary = json.loads(out)
    assert summary["measured"] == 4 and summary["last_round"]["measured"] == 6
    assert (campaign / "round_1" / "measurements.csv").read_text() == written
    assert "E9A" not in (campaign / "best.csv").read_text()


def test_a_round_that_repeats_an_earlier_rounds_rows_is_refused(tmp_path):
    """round_1's measurements copied to round_2: one line naming both files, no round 3."""
    campaign = start(tmp_path)
    measure(campaign, 1, [(m, f"{0.1 * i}") for i, m in enumerate(proposed(campaign, 1))])
    assert call(campaign)[0] == 0
    shutil.copyfile(campaign / "round_1" / "measurements.csv", campaign / "round_2" / "measurements.csv")
    refused(campaign, "round_2/measurements.csv: its rows repeat those of")
    assert not (campaign / "round_3").exists()


def test_each_round_writes_its_summary_and_the_best_so_far(tmp_path, monkeypatch):
    """round_N/summary.json is the line printed; best.csv lists the best measured variants, best first
    (mutations, value, round: the parent as WT), and is itself a file of measurements. The picture marks
    the parent's value where it was measured."""
    drawn = []
    monkeypatch.setattr(propose, "plot_campaign", lambda *args: drawn.append(args))
    before = tmp_path / "before.csv"
    before.write_text("mutations,value\nWT,0.5\nE8V,0.35\nW37L,-1\n")
    campaign = start(tmp_path, "--measurements", str(before))
    first = proposed(campaign, 1)
    assert not {"E8V", "W37L"} & set(first)
    values = [0.8, -0.2, 0.4, "NA", 0.1]
    measure(campaign, 1, list(zip(first, map(str, values), strict=True)))
    code, out, err = call(campaign)
    assert code == 0, err
    assert json.loads(out) == json.loads((campaign / "round_2" / "summary.json").read_text())
    assert json.loads(out)["best_file"] == str(campaign / "best.csv")
    lines = (campaign / "best.csv").read_text().splitlines()
    expected = sorted([("WT", 0.5, 0), ("E8V", 0.35, 0), ("W37L", -1.0, 0),
                       *((m, v, 1) for m, v in zip(first, values, strict=True) if v != "NA")],
                      key=lambda row: -row[1])  # fmt: skip
    assert lines[0] == "mutations,value,round"
    assert [args[-1] for args in drawn] == [0.5, 0.5] and [o.round for o in drawn[-1][1]] == [0, 1]
    assert [(m, float(v), int(n)) for m, v, n in (line.split(",") for line in lines[1:])] == expected
    rows = read_measurements(campaign / "best.csv")
    assert [(r.variant, r.value) for r in rows] == [(m, v) for m, v, _ in expected]
    code, out, err = call(tmp_path / "d", *START, "--measurements", str(campaign / "best.csv"))
    assert code == 0 and json.loads(out)["measured"] == len(expected), err


def test_blank_rows_are_no_measurements(tmp_path):
    """A line of spaces and a row of empty cells (as spreadsheets export them) are left out: no parent
    measured or failed; a bad value after them is named by its line."""
    campaign = start(tmp_path)
    first = proposed(campaign, 1)
    rows = "".join(f"{m},0.{i}\n" for i, m in enumerate(first))
    (campaign / "round_1" / "measurements.csv").write_text(f"mutations,value\n{rows} \t \n,\n")
    code, out, err = call(campaign)
    assert code == 0 and not err and json.loads(out)["failed"] == 0 and json.loads(out)["measured"] == 5, err
    measure(campaign, 2, [(m, "0.5") for m in proposed(campaign, 2)])
    path = campaign / "round_2" / "measurements.csv"
    path.write_text(path.read_text() + "\n \n,\nE8V,abc\n")
    refused(campaign, f"{path}:10: value must be a finite number")


def test_summaries_of_rounds_measured_by_a_function(tmp_path):
    """`propose` with a reward: each round's summary.json is the summary returned (measured_by included)."""
    import dpo_inv

    def reward(records: list[dict]) -> list[float]:
        return [float(record["sequence"].count("A")) for record in records]

    start = {"structure": str(STRUCTURE), "chain_id": ["A"], "positions": "A:8", "num_proposals": 3}
    summaries = dpo_inv.propose(tmp_path / "c", "vanilla/v_48_020", reward=reward, rounds=2, **start)
    for summary in summaries:
        written = json.loads((tmp_path / "c" / f"round_{summary['round']}" / "summary.json").read_text())
        assert written == summary and written["measured_by"] == "reward"
    assert summaries[-1]["picture"] == str(tmp_path / "c" / "campaign.png")


def test_an_include_in_a_space_too_large_to_list_need_not_be_among_the_drawn_candidates(tmp_path):
    """A sampled space's candidates are a draw: a variant of the space that the draw left out may be
    included; one outside the space may not."""
    space, _ = read_design_space(str(STRUCTURE), ["A"], "A:8,37", "AVILMFWY", 2)
    drawn = space.enumerate()[:3]
    (tmp_path / "mine.csv").write_text("mutations\nE8W:W37A\n")
    config = ProposeConfig(campaign=str(tmp_path / "c"), include=str(tmp_path / "mine.csv"), num_proposals=5)
    included = included_variants(space, config, read_history(space, []), drawn)
    assert [space.mutations(v) for v in included] == ["E8W:W37A"]
    (tmp_path / "mine.csv").write_text("mutations\nE8D\n")
    with pytest.raises(DataError, match="E8D is outside the campaign's design space"):
        included_variants(space, config, read_history(space, []), drawn)


def test_a_lower_is_better_campaign_lists_its_lowest_first(tmp_path):
    campaign = start(tmp_path, "--lower_is_better")
    measure(campaign, 1, [(m, f"{v}") for m, v in zip(proposed(campaign, 1), [3, 1, 2, 5, 4], strict=True)])
    code, _, err = call(campaign)
    assert code == 0, err
    values = [float(line.split(",")[1]) for line in (campaign / "best.csv").read_text().splitlines()[1:]]
    assert values == [1, 2, 3, 4, 5]


def test_included_variants_join_the_batch(tmp_path):
    """--include: its variants (written in any order of their mutations) are in the batch, picked_by
    include, with the model's picks making up the rest."""
    (tmp_path / "mine.csv").write_text("mutations,note\nW37A:E8W,a\nE8M,b\n")
    campaign = start(tmp_path, "--include", str(tmp_path / "mine.csv"))
    rows = list(csv.DictReader((campaign / "round_1" / "proposals.csv").open()))
    assert len(rows) == 5 and sorted(r["mutations"] for r in rows if r["picked_by"] == "include") == [
        "E8M",
        "E8W:W37A",
    ]
    assert all(r["picked_by"] != "include" for r in rows[2:])


@pytest.mark.parametrize(
    ("included", "message"),
    [
        ("E9A", "E9A is outside the campaign's design space"),
        ("E8D", "E8D is outside the campaign's design space"),
        ("E8A\nE8V\nE8I\nE8L\nE8M\nE8F", "6 variants, more than --num_proposals 5"),
    ],
)
def test_an_include_outside_the_space_or_beyond_the_batch_is_bad_input(tmp_path, included, message):
    (tmp_path / "mine.csv").write_text(f"mutations\n{included}\n")
    refused(tmp_path / "c", message, *START, "--include", str(tmp_path / "mine.csv"))
    assert not (tmp_path / "c").exists()


def test_an_include_already_measured_is_bad_input_and_a_failed_one_is_measured_again(tmp_path):
    campaign = start(tmp_path)
    first = proposed(campaign, 1)
    measure(campaign, 1, [(first[0], "NA"), *((m, "0.3") for m in first[1:])])
    (tmp_path / "mine.csv").write_text(f"mutations\n{first[1]}\n")
    refused(campaign, f"{first[1]} is measured already", "--include", str(tmp_path / "mine.csv"))
    assert not (campaign / "round_2").exists()
    (tmp_path / "mine.csv").write_text(f"mutations\n{first[0]}\n")
    code, _, err = call(campaign, "--include", str(tmp_path / "mine.csv"))
    assert code == 0 and proposed(campaign, 2)[0] == first[0], err


def test_a_parent_that_ends_in_alanine_keeps_its_scores_and_knows_what_it_measured(tmp_path):
    """Alanine is token 0: a variant ending in it keeps its whole key (a numpy bytes array would drop the
    trailing zero bytes, and the kept scores and the measured variants no longer matched)."""
    campaign = start(tmp_path, "--parent", "V48A")
    with np.load(campaign / "zero_shot.npz") as kept:
        assert len(kept["scores"]) == 71 and kept["columns"].tolist() == [7, 36]  # E8 and W37
    first = proposed(campaign, 1)
    measure(campaign, 1, [(m, "0.3") for m in first])
    (tmp_path / "mine.csv").write_text(f"mutations\n{first[1]}\n")
    refused(campaign, f"{first[1]} is measured already", "--include", str(tmp_path / "mine.csv"))
    code, _, err = call(campaign)
    assert code == 0 and not set(proposed(campaign, 2)) & set(first), err


def test_a_second_propose_on_a_running_campaign_is_refused(tmp_path):
    campaign = start(tmp_path)
    measure(campaign, 1, [(m, "0.1") for m in proposed(campaign, 1)])
    with contextlib.ExitStack() as stack:
        assert lock_folder(stack, campaign) is None
        refused(campaign, f"{campaign} is in use by another propose (pid ")
    assert not (campaign / "round_2").exists()
    assert call(campaign)[0] == 0  # once the first has ended


def test_a_campaign_with_nothing_measured_has_no_picture(tmp_path):
    campaign = start(tmp_path)
    drawn = command_in_process("plot", str(campaign))
    code, err = drawn.returncode, drawn.stderr
    assert code == 2 and "nothing measured yet" in err and len(err.strip().splitlines()) == 1, err
    assert not (campaign / "campaign.png").exists()


def test_the_picture_of_five_rounds(tmp_path):
    """Five rounds of 12, each predicted but the first, the parent measured at 0.2: a PNG."""
    rng = np.random.default_rng(0)
    outcomes = []
    for n in range(5):
        measured = rng.normal(0.1 * n, 0.5, 12)
        predicted = measured + rng.normal(0, 0.3, 12) if n else np.full(12, np.nan)
        outcomes.append(RoundOutcome(n, measured, predicted, np.abs(rng.normal(0.4, 0.1, 12)),
                                     rng.normal(0, 1, 12), measured))  # fmt: skip
    path = tmp_path / "campaign.png"
    plot_campaign(path, outcomes, False, "five rounds", parent_value=0.2)
    assert path.read_bytes()[:4] == b"\x89PNG"
