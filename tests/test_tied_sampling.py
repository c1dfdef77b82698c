"""Sampling with tied positions (homo-oligomers, symmetric designs), with the official weights."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import STRUCTURES

from dpo_inv.data.batches import collate
from dpo_inv.models.mpnn import ProteinMPNN, sequence_log_probs
from dpo_inv.models.sampling import Samples, allowed_tokens, sample_sequences
from dpo_inv.models.weights import load_model
from dpo_inv.structures.parse import ALPHABET
from dpo_inv.tools.sample import parse_fixed_positions, prepare_design

CHAIN = 98  # 1hvr: HIV protease, two identical chains of 98 residues


@pytest.fixture(scope="module")
def model() -> ProteinMPNN:
    return load_model("vanilla/v_48_020")


def make_batch(*designs: tuple[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """A ``collate`` batch of (structure file, fixed positions), every chain designed."""
    return collate(
        [
            prepare_design(STRUCTURES / name, [], [], parse_fixed_positions(fixed)).example
            for name, fixed in designs
        ]
    )


def ties(L: int, *groups: Sequence[int]) -> torch.Tensor:
    """``tied [L]``: each group's positions point to its first one."""
    tied = torch.arange(L)
    for group in groups:
        tied[list(group)] = group[0]
    return tied


@pytest.fixture(scope="module")
def dimer() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """1hvr with position i of chain B tied to position i of chain A."""
    return make_batch(("1hvr.pdb.gz", [])), ties(2 * CHAIN, *[(i, i + CHAIN) for i in range(CHAIN)])[None]


def teacher_forced(model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples) -> torch.Tensor:
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


def check_log_probs(model: ProteinMPNN, batch: dict[str, torch.Tensor], samples: Samples) -> None:
    forced = sequence_log_probs(teacher_forced(model, batch, samples), samples.tokens)
    assert (forced * batch["mask"].unsqueeze(1) - samples.log_probs).abs().max() <= 1e-4


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
    forced = teacher_forced(model, batch, samples)
    members = forced[..., :CHAIN, :], forced[..., CHAIN:, :]

    def greedy(logits: torch.Tensor) -> torch.Tensor:
        return (logits + bias).masked_fill(~allowed_tokens(""), float("-inf")).argmax(-1)

    assert torch.equal(greedy((members[0] + members[1]) / 2), samples.tokens[..., :CHAIN])
    assert not torch.equal(greedy(members[0] + members[1]), samples.tokens[..., :CHAIN])  # a sum
    assert not torch.equal(greedy(members[0]), samples.tokens[..., :CHAIN])  # the head alone


def test_groups_of_different_sizes_in_a_batch(model):
    """1hvr, ties of 2 and 3 positions and no context, has fewer steps than 3gfsA beside it."""
    batch = make_batch(("1hvr.pdb.gz", []), ("3gfsA.pdb.gz", []))
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
    alone = make_batch(("3gfsA.pdb.gz", []))
    n = alone["mask"].shape[1]
    expected = sample_sequences(model, alone, num_samples=2, temperature=0.5, seeds=[8], omit_aas="C")
    assert n < L and torch.equal(samples.tokens[1, :, :n], expected.tokens[0])
    torch.testing.assert_close(samples.log_probs[1, :, :n], expected.log_probs[0], atol=1e-4, rtol=0)


def test_without_ties_the_samples_are_unchanged(model):
    batch = make_batch(("2xcjA.pdb.gz", ["A:10-20"]))
    plain = sample_sequences(model, batch, num_samples=2, temperature=0.3, seeds=[9])
    identity = torch.arange(batch["mask"].shape[1])[None]
    lone = sample_sequences(model, batch, num_samples=2, temperature=0.3, seeds=[9], tied=identity)
    for name in ("tokens", "log_probs", "ranks"):
        assert torch.equal(getattr(plain, name), getattr(lone, name))


def test_bad_ties_are_rejected(model):
    batch = make_batch(("2xcjA.pdb.gz", ["A:10-20"]))
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
