"""The models of a campaign: the variants a round chooses from (listed, from a file, or sampled from the
model) and their scores — the zero-shot joint score (the mean of several models') and, where the round
adapts, the adapted model's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dpo_inv.data.batches import collate, structure_inputs
from dpo_inv.data.design import MAX_CANDIDATES, DesignSpace, variant_keys
from dpo_inv.models.combinations import MAX_ORDERS, joint_deltas, joint_plan
from dpo_inv.models.mpnn import ProteinMPNN, derive_seed
from dpo_inv.models.sampling import sample_sequences
from dpo_inv.models.variants import conditional_log_probs
from dpo_inv.structures.parse import ALPHABET, AMINO_ACIDS
from dpo_inv.tools.adapt import Adapted, AdaptOptions, choose_and_train, variant_set
from dpo_inv.tools.ridge import model_fingerprint

# the adapted model trains on and scores one order of a combination's mutated positions (four: 3.4x as long)
ADAPTED_ORDERS = 1
# where the space is too large to list: this many sets of positions, this many samples on each
SAMPLED_SETS = 128
SAMPLES_PER_SET = 16
SETS_PER_PASS = 16


@dataclass
class ModelScorer:
    """The zero-shot and adapted scores of variants of ``space`` on ``example`` (its structure): the zero-shot
    score is the mean of ``models``' joint delta_logp (``orders`` orders of each variant's mutated
    positions), the first model the one adapted; ``known`` holds scores computed before (a variant's key to
    its zero-shot score), looked up instead of computed again."""

    models: list[ProteinMPNN]
    example: dict[str, Any]
    space: DesignSpace
    device: torch.device
    orders: int = MAX_ORDERS
    known: dict[bytes, float] = field(default_factory=dict)

    def zero_shot(self, variants: np.ndarray) -> np.ndarray:
        keys = variant_keys(variants)
        missing = np.array([k not in self.known for k in keys], dtype=bool)
        if missing.any():
            rows = variants[missing]
            scores = np.mean([zero_shot(m, self.example, self.space, rows, self.device, self.orders)
                              for m in self.models], 0)  # fmt: skip
            self.known.update(zip(keys[missing], scores.tolist(), strict=True))
        return np.array([self.known[k] for k in keys], dtype=np.float64)

    def fingerprint(self) -> str:
        """What the zero-shot scores depend on, hashed: each model's settings and weights, the structure's
        inputs, the parent and the orders (not the device: its rounding is far below the scores' use)."""
        digest = hashlib.sha256(f"{self.orders} {self.space.positions.tolist()}".encode())
        for model in self.models:
            settings = {k: v for k, v in model.config.to_dict().items() if k not in UNSCORED_SETTINGS}
            digest.update((repr(sorted(settings.items())) + model_fingerprint(model)).encode())
        for name in sorted(self.example):
            digest.update(name.encode() + as_bytes(self.example[name]))
        digest.update(as_bytes(self.space.parent))
        return digest.hexdigest()

    def adapt(self, measured: np.ndarray, values: np.ndarray, seed: int) -> Adapted:
        """`dpo-inv adapt` of the first model on the measured variants (higher values better)."""
        visible = np.asarray(self.example["native"][len(self.space.parent) :])
        parent = torch.from_numpy(np.concatenate([self.space.parent, visible]))
        batch = {k: v.to(self.device) for k, v in collate([{**self.example, "wildtype": parent}]).items()}
        variants = np.hstack([measured, np.broadcast_to(visible, (len(measured), len(visible)))])
        config = AdaptOptions(decoding_order="left_to_right", seed=seed)
        sets = [variant_set(self.models[0], batch, variants, values, None, max_orders=ADAPTED_ORDERS)]
        return choose_and_train(self.models[0], sets, config)

    def adapted(self, adapted: Adapted, variants: np.ndarray) -> np.ndarray:
        """The adapted model's joint score of ``variants`` (one order)."""
        return zero_shot(
            adapted.model.eval(), self.example, self.space, variants, self.device, ADAPTED_ORDERS
        )


# a model's settings that name where it came from, not what it computes
UNSCORED_SETTINGS = {"_name_or_path", "name_or_path", "transformers_version", "merged_adapters"}


def as_bytes(value: Any) -> bytes:
    """A tensor's or an array's bytes (any dtype), or another value's repr."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    return repr(value).encode()


def example_ca(example: dict[str, Any], length: int) -> np.ndarray:
    """``[length, 3]`` Cα coordinates of the designed chains' residues (NaN where unobserved)."""
    ca = np.asarray(example["X"], dtype=np.float64)[:length, 1].copy()
    ca[np.asarray(example["mask"])[:length] == 0] = np.nan
    return ca


def sampled(space: DesignSpace, candidates_file: str | None) -> bool:
    """Whether a round's candidates are drawn from the model: no candidates file, a space too large."""
    return candidates_file is None and space.size() > MAX_CANDIDATES


@torch.no_grad()
def sampled_variants(model: ProteinMPNN, example: dict[str, Any], space: DesignSpace, seed: int,
                     device: torch.device) -> np.ndarray:  # fmt: skip
    """Distinct variants of the space drawn from the model: `SAMPLED_SETS` sets of at most k positions,
    drawn by how much the model would change each one (its probability of an allowed substitution there,
    the rest of the parent given), then `SAMPLES_PER_SET` samples at temperature 1 with only the set
    designed; amino acids the space does not allow are left out."""
    visible = np.asarray(example["native"][len(space.parent) :])
    parent = torch.from_numpy(np.concatenate([space.parent, visible]))
    base = {**example, "native": parent, "wildtype": parent}
    batch = {k: v.to(device) for k, v in collate([base]).items()}
    probs = conditional_log_probs(model, batch, space.positions.tolist(), None).exp().cpu().numpy()
    weights = np.array([probs[i, tokens].sum() for i, tokens in enumerate(space.allowed)]) + 1e-9
    rng = np.random.default_rng(seed)
    k = min(space.max_mutations, len(space.positions))
    sets: dict[tuple[int, ...], None] = {}
    for _ in range(4 * SAMPLED_SETS):  # Gumbel top-k: k positions drawn without replacement
        keys = np.log(weights) + rng.gumbel(size=len(weights))
        sets.setdefault(tuple(sorted(space.positions[np.argsort(-keys)[:k]].tolist())))
        if len(sets) == SAMPLED_SETS:
            break
    anywhere = {int(t) for tokens in space.allowed for t in tokens}
    omit = "".join(a for a in AMINO_ACIDS if ALPHABET.index(a) not in anywhere)
    allowed = np.zeros((len(space.parent), len(ALPHABET)), dtype=bool)
    allowed[np.arange(len(space.parent)), space.parent] = True
    for position, tokens in zip(space.positions, space.allowed, strict=True):
        allowed[position, tokens] = True
    found = []
    chosen = list(sets)
    for start in range(0, len(chosen), SETS_PER_PASS):
        examples = []
        for positions in chosen[start : start + SETS_PER_PASS]:
            mutable = np.zeros(len(space.parent), np.float32)
            mutable[list(positions)] = 1
            examples.append({**base, "mutable": mutable})
        seeds = [derive_seed(seed, start + i) for i in range(len(examples))]
        samples = sample_sequences(model, collate(examples), SAMPLES_PER_SET, 1.0, seeds, omit,
                                   max_mutations=k)  # fmt: skip
        tokens = samples.tokens[:, :, : len(space.parent)].reshape(-1, len(space.parent)).cpu().numpy()
        found.append(tokens[allowed[np.arange(tokens.shape[1]), tokens].all(1)])
    variants = np.unique(np.concatenate(found), axis=0)
    return variants[(variants != space.parent).any(1)]


@torch.no_grad()
def zero_shot(model: ProteinMPNN, example: dict[str, Any], space: DesignSpace, variants: np.ndarray,
              device: torch.device, max_orders: int = MAX_ORDERS) -> np.ndarray:  # fmt: skip
    """The model's joint `delta_logp` of each variant against the parent (its mutated positions decoded in
    at most ``max_orders`` orders)."""
    batch = {k: v.to(device) for k, v in collate([example]).items()}
    enc = model.encode(**structure_inputs(batch))
    visible = np.asarray(example["native"][len(space.parent) :])  # the chains not designed
    parent = np.concatenate([space.parent, visible])
    visible_rows = np.broadcast_to(visible.astype(variants.dtype), (len(variants), len(visible)))
    variants = np.hstack([variants, visible_rows])
    plan = joint_plan(parent, variants, np.arange(len(parent)), model.config.vocab_size, max_orders)
    return joint_deltas(model, enc, torch.from_numpy(parent).to(device), plan).numpy().astype(np.float64)
