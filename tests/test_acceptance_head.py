"""The acceptance head (bild_env.models.acceptance) and its command (python -m distill acceptance), on tiny-random."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bild_env.decoding.decoders import batched_greedy
from bild_env.models.acceptance import (
    HEAD_FILE, SCALARS, AcceptanceHead, HeadMismatchError, HeadSpec, capture_final_hidden, draft_features, draft_key,
    hidden_from_outputs, load_head, save_head,
)
from bild_env.prompts.domains import load_domain
from distill import acceptance


@pytest.fixture(scope="module")
def rows(tiny_pair):
    """One prose prompt, the target's greedy continuation, and its collected rows."""
    prompt = load_domain(tiny_pair.tokenizer, "prose", "train", 1)[0]
    new = batched_greedy(tiny_pair.target, [prompt], 10, tiny_pair.eos_token_ids)[0]
    data = acceptance.read_positions(tiny_pair, prompt, new, 4, np.random.default_rng(0))
    return prompt, new, data


def test_features_have_the_shapes_the_head_reads(tiny_pair, rows):
    _, new, data = rows
    n, hidden, layers = len(new) - 1, tiny_pair.draft.config.hidden_size, tiny_pair.draft.config.num_hidden_layers
    assert data["hidden"].shape == (n, layers, hidden)
    for name in ("label", *SCALARS):
        assert data[name].shape == (n,), name
    assert data["depth"][0] == 0 and data["depth"].max() <= 3  # blocks of 1..4 proposals, the first at row 1
    assert torch.all((data["running_acceptance"] > 0) & (data["running_acceptance"] < 1))
    for features in acceptance.FEATURE_SETS:
        spec = acceptance.head_spec(tiny_pair, features, 0)
        assert acceptance.feature_matrix(spec, data).shape == (n, spec.n_features)


def test_training_features_equal_what_a_decoder_computes_from_a_forward(tiny_pair, rows):
    prompt, new, data = rows
    spec = acceptance.head_spec(tiny_pair, "layers", 0)
    ids = torch.tensor([prompt + new[:-1]])
    with torch.inference_mode(), capture_final_hidden(tiny_pair.draft) as finals:
        out = tiny_pair.draft(ids, output_hidden_states=True, logits_to_keep=len(new) - 1)
    hidden = [h[0, -(len(new) - 1):] for h in hidden_from_outputs(spec, out.hidden_states, finals[-1])]
    live = draft_features(spec, hidden, out.logits[0], data["depth"], data["target_max_prob"], data["running_acceptance"])
    torch.testing.assert_close(live, acceptance.feature_matrix(spec, data), rtol=1e-5, atol=1e-5)


def test_labels_equal_draft_argmax_against_target_argmax_by_hand(tiny_pair, rows):
    from bench.decoders import draft_agreement

    prompt, new, data = rows
    for r in (1, 4, len(new) - 1):  # row r proposes new[r] after prompt + new[:r]
        ids = torch.tensor([prompt + new[:r]])
        with torch.inference_mode():
            a = int(tiny_pair.draft(ids).logits[0, -1].argmax())
            b = int(tiny_pair.target(ids).logits[0, -1].argmax())
        assert data["label"][r - 1] == float(a == b) and data["proposal"][r - 1] == a
    assert float(data["label"].mean()) == pytest.approx(draft_agreement(tiny_pair, [prompt], [new])["agreement"])


def test_auc_ece_brier_and_calibrators_match_hand_computed_cases():
    y = np.array([0, 0, 1, 1])
    assert acceptance.auc(np.array([0.1, 0.4, 0.35, 0.8]), y) == 0.75  # 3 of 4 (positive, negative) pairs in order
    assert acceptance.auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5  # a tie counts half
    assert acceptance.auc(np.array([0.2, 0.3]), np.array([1, 1])) is None
    p, y = np.array([0.05, 0.15, 0.95, 0.95]), np.array([0, 1, 1, 0])
    # bins 0, 1 and 9: 1/4 |0.05 - 0| + 1/4 |0.15 - 1| + 2/4 |0.95 - 0.5|
    assert acceptance.ece(p, y) == pytest.approx(0.0125 + 0.2125 + 0.225)
    assert acceptance.ece(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0  # probability 1 falls in the last bin
    assert acceptance.brier(p, y) == pytest.approx((0.05**2 + 0.85**2 + 0.05**2 + 0.95**2) / 4)
    steps = acceptance.isotonic(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 1, 0, 1]))
    np.testing.assert_allclose(acceptance.apply_isotonic(np.array([0.0, 0.15, 0.25, 0.45]), steps), [0, 0, 0.5, 1])
    rng = np.random.default_rng(0)
    score = rng.uniform(0.01, 0.99, 4000)
    a, b = acceptance.platt(score, rng.uniform(size=4000) < score)  # already calibrated: a ~ 1, b ~ 0
    assert a == pytest.approx(1, abs=0.15) and b == pytest.approx(0, abs=0.15)


def test_a_head_saves_and_loads_bit_for_bit(tiny_pair, tmp_path):
    spec = acceptance.head_spec(tiny_pair, "layers", 16)
    torch.manual_seed(0)
    head = AcceptanceHead(spec)
    head.set_scale(torch.randn(50, spec.n_features) * 3 + 1)
    path = save_head(head, tmp_path)
    assert path == tmp_path / HEAD_FILE
    loaded = load_head(tmp_path, tiny_pair.draft, draft_key(tiny_pair.fingerprints[0], tiny_pair.draft_vocab))
    assert loaded.spec == spec and loaded.spec.notes == spec.notes
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    x = torch.randn(7, spec.n_features)
    assert torch.equal(head.probability(x), loaded.probability(x))


def test_a_mismatched_or_missing_head_is_refused_with_what_to_do(tiny_pair, tmp_path):
    key = draft_key(tiny_pair.fingerprints[0], tiny_pair.draft_vocab)
    with pytest.raises(HeadMismatchError, match="no acceptance head at .*python -m distill acceptance"):
        load_head(tmp_path / "nowhere", tiny_pair.draft, key)
    save_head(AcceptanceHead(HeadSpec(32, 2, (2,), SCALARS, 0, key)), tmp_path / "narrow")
    with pytest.raises(HeadMismatchError, match="hidden size 32 .* the draft has hidden size 64"):
        load_head(tmp_path / "narrow", tiny_pair.draft, key)
    save_head(AcceptanceHead(HeadSpec(64, 2, (2,), SCALARS, 0, "local:other|draft-vocab=full")), tmp_path / "other")
    with pytest.raises(HeadMismatchError, match="fitted on draft 'local:other"):
        load_head(tmp_path / "other", tiny_pair.draft, key)
    (tmp_path / "junk.pt").write_bytes(b"not a head")
    with pytest.raises(HeadMismatchError, match="is not an acceptance head"):
        load_head(tmp_path / "junk.pt")
    with pytest.raises(HeadMismatchError, match="reads 1 hidden state"):
        draft_features(HeadSpec(64, 2, (2,)), [], torch.zeros(1, 5), *torch.zeros(3, 1))


def test_the_distill_acceptance_command_runs_end_to_end(tmp_path, capsys):
    from distill.cli import main

    out, head_dir = tmp_path / "acceptance.json", tmp_path / "head"
    main(["acceptance", "--pair", "tiny-random", "--train-prompts", "3", "--eval-prompts", "2", "--max-new-tokens", "10",
          "--feature-sets", "confidence", "last", "--widths", "0", "8", "--weight-decays", "0", "--epochs", "2", "--timing-repeats", "5",
          "--head-out", str(head_dir), "--out", str(out)])
    result = json.loads(out.read_text())
    assert "best head" in capsys.readouterr().out
    assert len(result["grid"]) == 4 and result["best"] in {row["head"] for row in result["grid"]}
    for split in ("validation", "test"):
        for domain in ("prose", "code", "chat"):
            row = result[split][domain]
            assert row["positions"] > 0 and row["prompts"] == 2
            for scorer in ("head", "max_prob", "max_prob_platt", "max_prob_isotonic"):
                assert set(row[scorer]) == {"auc", "ece", "brier"}
    margins = result["validation_auc_margin"]
    assert result["adopted"] == all(m > 0 for m in margins.values())
    assert result["cost"]["head_ms"] > 0 and result["cost"]["draft_forward_ms"] > 0 and result["machine"]
    load_head(result["head_file"])  # written where asked, and loadable
    assert result["head_file"] == str(head_dir / HEAD_FILE)
    with pytest.raises(SystemExit, match="error: unknown --feature-sets"):
        main(["acceptance", "--pair", "tiny-random", "--feature-sets", "everything"])
