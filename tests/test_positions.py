"""The draft's proposals read along the target's greedy continuations (distill.positions: what the lookup predictor is
fitted on) and the scores a predictor is reported by, on tiny-random."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bild_env.decoding.batched import generate_batched_target_only
from bild_env.prompts.domains import load_domain
from distill import positions


@pytest.fixture(scope="module")
def rows(tiny_pair):
    """One prose prompt, the target's greedy continuation, and its collected rows."""
    prompt = load_domain(tiny_pair.tokenizer, "prose", "train", 1)[0]
    new = generate_batched_target_only(tiny_pair, [prompt], 10)[0].new_ids
    data = positions.read_positions(tiny_pair, prompt, new, 4, np.random.default_rng(0))
    return prompt, new, data


def test_every_row_holds_its_numbers_and_blocks_of_at_most_max_block(rows):
    _, new, data = rows
    n = len(new) - 1
    for name in ("label", "max_prob", "entropy", "margin", "depth", "target_max_prob", "running_acceptance",
                 "proposal", "target_argmax"):
        assert data[name].shape == (n,), name
    assert data["depth"][0] == 0 and data["depth"].max() <= 3  # blocks of 1..4 proposals, the first at row 1
    assert torch.all((data["running_acceptance"] > 0) & (data["running_acceptance"] < 1))
    assert torch.all((data["margin"] >= 0) & (data["margin"] <= data["max_prob"]))


def test_labels_equal_draft_argmax_against_target_argmax_by_hand(tiny_pair, rows):
    from bench.decoders import draft_agreement

    prompt, new, data = rows
    for r in (1, 4, len(new) - 1):  # row r proposes new[r] after prompt + new[:r]
        ids = torch.tensor([prompt + new[:r]])
        with torch.inference_mode():
            z = tiny_pair.draft(ids).logits[0, -1]
            a = int(z.argmax())
            b = int(tiny_pair.target(ids).logits[0, -1].argmax())
        assert data["label"][r - 1] == float(a == b) and data["proposal"][r - 1] == a
        assert float(data["max_prob"][r - 1]) == pytest.approx(float(torch.softmax(z.float(), -1).max()), rel=1e-5)
    assert float(data["label"].mean()) == pytest.approx(draft_agreement(tiny_pair, [prompt], [new])["agreement"])


def test_blocks_start_where_the_simulation_says():
    starts = positions.simulate_blocks(9, 3, np.random.default_rng(1))
    assert starts[0] == 1 and all(1 <= r - s + 1 <= 3 for r, s in zip(range(1, 10), starts))
    assert all(b == a or b == r for r, (a, b) in enumerate(zip(starts, starts[1:]), start=2))  # a block or a new one


def test_auc_ece_brier_match_hand_computed_cases():
    y = np.array([0, 0, 1, 1])
    assert positions.auc(np.array([0.1, 0.4, 0.35, 0.8]), y) == 0.75  # 3 of 4 (positive, negative) pairs in order
    assert positions.auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5  # a tie counts half
    assert positions.auc(np.array([0.2, 0.3]), np.array([1, 1])) is None
    p, y = np.array([0.05, 0.15, 0.95, 0.95]), np.array([0, 1, 1, 0])
    # bins 0, 1 and 9: 1/4 |0.05 - 0| + 1/4 |0.15 - 1| + 2/4 |0.95 - 0.5|
    assert positions.ece(p, y) == pytest.approx(0.0125 + 0.2125 + 0.225)
    assert positions.ece(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0  # probability 1 falls in the last bin
    assert positions.brier(p, y) == pytest.approx((0.05**2 + 0.85**2 + 0.05**2 + 0.95**2) / 4)
