"""DPO loss formulas against hand-computed values, and pair log-probabilities against the model."""

import math

import pytest
import torch
from conftest import SHARED_DATA

from dpo_inv.data.batches import ExampleDataset, collate
from dpo_inv.data.dataset import load_records
from dpo_inv.models.mpnn import decoding_ranks, sequence_log_probs
from dpo_inv.models.weights import load_model
from dpo_inv.training.config import DPOConfig
from dpo_inv.training.loss import (
    METRICS,
    PairLogps,
    anchor_kl,
    batch_ranks,
    dpo_loss,
    pair_logps,
    preference_loss,
)
from dpo_inv.training.objective import step_metrics

# policy prefers the chosen sequence by 2 nats more than the reference does
POLICY = PairLogps(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([4.0]))
REFERENCE = PairLogps(torch.tensor([-11.0]), torch.tensor([-11.0]), torch.tensor([4.0]))
BETA = 0.1


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    "loss_type, label_smoothing, expected",
    [
        ("sigmoid", 0.0, softplus(-0.2)),
        ("sigmoid", 0.1, 0.9 * softplus(-0.2) + 0.1 * softplus(0.2)),
        ("robust", 0.1, (0.9 * softplus(-0.2) - 0.1 * softplus(0.2)) / 0.8),
        ("hinge", 0.0, 1 - 0.2),
        ("ipo", 0.0, (2 / 4 - 1 / (2 * BETA)) ** 2),
    ],
)
def test_loss_formulas(loss_type, label_smoothing, expected):
    out = dpo_loss(POLICY, REFERENCE, BETA, loss_type, label_smoothing)
    assert out.losses.item() == pytest.approx(expected, rel=1e-6)
    assert out.chosen_rewards.item() == pytest.approx(0.1)
    assert out.rejected_rewards.item() == pytest.approx(-0.1)


def test_reference_free_uses_zero_reference():
    out = dpo_loss(POLICY, None, BETA, "sigmoid")
    assert out.losses.item() == pytest.approx(softplus(-0.2))
    assert out.chosen_rewards.item() == pytest.approx(-1.0)
    assert out.rejected_rewards.item() == pytest.approx(-1.2)


def test_combined_losses_sft_and_example_weight():
    """sft is the NLL of the preferred sequence per loss position (TRL's sft term, once rpo_alpha)."""
    total, _ = preference_loss(
        POLICY,
        REFERENCE,
        weight=torch.tensor([2.0]),
        beta=BETA,
        loss_types=["sigmoid", "hinge", "sft"],
        loss_weights=[1.0, 0.5, 0.5],
    )
    assert total.item() == pytest.approx(2.0 * (softplus(-0.2) + 0.5 * 0.8 + 0.5 * 10 / 4))


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="unknown loss_type 'kto'"):
        dpo_loss(POLICY, REFERENCE, BETA, "kto")


@pytest.mark.slow
def test_pair_logps_sum_loss_positions_and_average_orders():
    data = load_records(SHARED_DATA / "multichain.jsonl")
    batch = collate([ExampleDataset(data)[i] for i in (0, 1)])  # 1hvr (A designed, B fixed), 1BD2 peptide
    batch["loss_mask"][0, 10:20] = 0  # as if only some positions were mutable
    model = load_model("vanilla/v_48_020")
    ranks = decoding_ranks(batch["decode_mask"], batch["mask"], [1, 2], num_orders=2)
    with torch.no_grad():
        logps = pair_logps(model, batch, ranks)
        for name, value in (("chosen", logps.chosen), ("rejected", logps.rejected)):
            expected = torch.stack(
                [
                    (
                        sequence_log_probs(
                            model(
                                batch["X"],
                                batch[name],
                                batch["mask"],
                                batch["residue_idx"],
                                batch["chain_encoding"],
                                ranks[:, k],
                            ),
                            batch[name],
                        )
                        * batch["loss_mask"]
                    ).sum(-1)
                    for k in range(2)
                ]
            ).mean(0)
            torch.testing.assert_close(value, expected, atol=1e-4, rtol=1e-5)
    assert logps.num_positions.tolist() == [88.0, 9.0]


@pytest.mark.slow
def test_anchor_kl_is_the_reference_to_policy_kl_outside_the_scored_positions():
    data = load_records(SHARED_DATA / "multichain.jsonl")
    batch = collate([ExampleDataset(data)[i] for i in (0, 1)])
    batch["loss_mask"][0] = 0
    batch["loss_mask"][0, 5] = 1  # one scored position, as a same-position pair has
    reference, policy = load_model("vanilla/v_48_020"), load_model("vanilla/v_48_020")
    with torch.no_grad():
        policy.W_out.bias += torch.linspace(-0.5, 0.5, policy.W_out.bias.numel())
    ranks = decoding_ranks(batch["decode_mask"], batch["mask"], [1, 2])
    with torch.no_grad():
        mine, theirs = pair_logps(policy, batch, ranks), pair_logps(reference, batch, ranks)
        outside = batch["mask"] - batch["loss_mask"]
        assert anchor_kl(theirs, theirs, outside).abs().max() < 1e-6  # the policy at its start: 0
        inputs = [batch[k] for k in ("X", "chosen", "mask", "residue_idx", "chain_encoding")]
        ref, new = reference(*inputs, ranks[:, 0]), policy(*inputs, ranks[:, 0])
        kl = torch.nn.functional.kl_div(new, ref, log_target=True, reduction="none").sum(-1)
        expected = (kl * outside).sum(-1) / outside.sum(-1)
        torch.testing.assert_close(anchor_kl(mine, theirs, outside), expected, atol=1e-5, rtol=1e-4)
        assert (expected > 0).all()


@pytest.mark.slow
def test_the_anchor_term_adds_to_the_training_loss():
    data = load_records(SHARED_DATA / "multichain.jsonl")
    batch = collate([ExampleDataset(data)[i] for i in (0, 1)])
    reference, policy = load_model("vanilla/v_48_020"), load_model("vanilla/v_48_020")
    with torch.no_grad():
        policy.W_out.bias += torch.linspace(-0.5, 0.5, policy.W_out.bias.numel())
        plain, rows = step_metrics(DPOConfig(), policy, reference, batch, 0)
        anchored, anchored_rows = step_metrics(DPOConfig(anchor_weight=2.0), policy, reference, batch, 0)
        ranks = batch_ranks(batch, 42, 1, "random")
        kl = anchor_kl(pair_logps(policy, batch, ranks), pair_logps(reference, batch, ranks),
                       batch["mask"] - batch["loss_mask"])  # fmt: skip
    torch.testing.assert_close(anchored, plain + 2.0 * kl.mean(), atol=1e-5, rtol=1e-5)
    # the metrics come by name, TRL's: the logged loss is the loss trained on
    assert list(rows) == list(METRICS) and list(anchored_rows) == list(METRICS)
    torch.testing.assert_close(anchored_rows["loss"].mean(), anchored)
    assert torch.equal(rows["logps/chosen"], anchored_rows["logps/chosen"])
    with pytest.raises(ValueError, match="anchor_weight needs pairs and the reference model"):
        DPOConfig(anchor_weight=1.0, precompute_ref_log_probs=True)
