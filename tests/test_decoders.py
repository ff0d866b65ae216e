"""The three decoders on tiny local models: exactness against generate(), KV-cache state, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from bild_env import (
    PairError,
    generate_bild,
    generate_speculative,
    generate_target_only,
    load_pair,
    new_bild_session,
)
from bild_env.decoding.stats import DecodeStats
from bild_env.models.compat import cache_kwarg

LN2 = math.log(2)


def random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(pair, ids: list[int], max_new_tokens: int) -> list[int]:
    out = pair.target.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pair.tokenizer.eos_token_id
    )
    return out[0, len(ids) :].tolist()


CASES = [(seed, length) for seed in range(4) for length in (1, 7, 30)]


@pytest.mark.parametrize("pair_name", ["tiny_pair", "agreeing_pair"])
def test_exact_decoders_equal_target_greedy(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    spec_seen, bild_seen = DecodeStats(), DecodeStats()
    for seed, length in CASES:
        ids = random_prompt(seed, length)
        ref = reference(pair, ids, 24)
        assert generate_target_only(pair, ids, 24).new_ids == ref
        for k in (1, 3, 8):
            g = generate_speculative(pair, ids, k=k, max_new_tokens=24)
            assert g.new_ids == ref, (seed, length, k)
            spec_seen += g.stats
        for fallback in (0.0, 0.103, 0.6, 1.0):
            for max_draft_len in (1, 4, 10):
                g = generate_bild(pair, ids, fallback, 0.5, max_draft_len, 24)
                assert g.new_ids == ref, (seed, length, fallback, max_draft_len)
                bild_seen += g.stats
    partial = spec_seen.steps - spec_seen.full_accepts
    print(f"\n{pair_name} naive SD: {spec_seen.steps} rounds, {spec_seen.full_accepts} fully accepted, "
          f"{partial} with a rejection, acceptance {spec_seen.acceptance_rate:.2f}")
    print(f"{pair_name} BiLD (rollback {0.5} < ln 2): {bild_seen.steps} steps, {bild_seen.full_accepts} fully accepted, "
          f"{bild_seen.rollbacks} rollbacks, {bild_seen.fallbacks} fallbacks, acceptance {bild_seen.acceptance_rate:.2f}")
    # the exactness above must have covered every branch of the algorithms
    assert spec_seen.full_accepts > 0 and partial > 0 and 0 < spec_seen.accepted < spec_seen.proposed
    assert bild_seen.full_accepts > 0 and bild_seen.rollbacks > 0 and bild_seen.fallbacks > 0
    assert 0 < bild_seen.accepted < bild_seen.proposed


@pytest.mark.parametrize("pair_name", ["tiny_pair", "agreeing_pair"])
def test_adaptive_speculative_is_exact_and_stops_on_low_confidence(pair_name, request):
    """The draft's confidence stop changes how many tokens it proposes, never the output; at confidence 1 every
    proposal is unsure (max prob < 1), so each round proposes one token: the same rounds as k = 1, whatever k."""
    pair = request.getfixturevalue(pair_name)
    stopped = 0
    for seed, length in CASES:
        ids = random_prompt(seed, length)
        ref = reference(pair, ids, 24)
        for confidence in (0.05, 0.3, 0.6):
            g = generate_speculative(pair, ids, k=6, max_new_tokens=24, confidence=confidence)
            assert g.new_ids == ref, (seed, length, confidence)
            assert g.stats.fallbacks <= g.stats.steps and g.stats.proposed <= 6 * g.stats.steps
            stopped += g.stats.fallbacks
        one, sure = generate_speculative(pair, ids, 1, 24), generate_speculative(pair, ids, 8, 24, confidence=1.0)
        assert sure.new_ids == ref
        for name in ("steps", "proposed", "accepted", "full_accepts", "draft_forwards", "target_forwards"):
            assert getattr(sure.stats, name) == getattr(one.stats, name), name
        assert sure.stats.fallbacks == sure.stats.proposed and one.stats.fallbacks == 0
        plain = generate_speculative(pair, ids, 4, 24)
        assert generate_speculative(pair, ids, 4, 24, confidence=0.0).stats.proposed == plain.stats.proposed
    assert stopped > 0  # the stop was exercised below confidence 1


def test_eos_ends_every_decoder_alike(tiny_pair):
    """Make the target's 5th greedy token its EOS: every decoder stops right after it."""
    ids = random_prompt(11, 9)
    ref = reference(tiny_pair, ids, 12)
    eos = ref[4]
    stop = ref.index(eos) + 1
    saved = tiny_pair.eos_token_ids
    tiny_pair.eos_token_ids = (eos,)
    try:
        outs = [generate_target_only(tiny_pair, ids, 12), generate_speculative(tiny_pair, ids, 4, 12),
                generate_bild(tiny_pair, ids, 0.1, 0.5, 10, 12), generate_bild(tiny_pair, ids, 0.0, 0.5, 3, 12)]
    finally:
        tiny_pair.eos_token_ids = saved
    for g in outs:
        assert g.new_ids == ref[:stop]
        assert g.stats.new_tokens == stop


def test_caches_hold_exactly_the_committed_prefix_after_rollback(tiny_pair):
    pair = tiny_pair
    rollbacks = 0
    for seed in range(6):
        s = new_bild_session(pair, random_prompt(seed, 12), max_new_tokens=40)
        while not s.done:
            step = s.step(0.0, 1.0)
            if not step.rollbacks:
                continue
            rollbacks += 1
            runner = s.runner
            # after a rollback the target also emitted the next token: it lacks only that one
            assert runner.lengths["target"] == len(s.tokens) - 1
            assert runner.lengths["draft"] <= len(s.tokens) - 1
            for role in ("draft", "target"):
                model, cache, n = getattr(pair, role), runner.caches[role], runner.lengths[role]
                assert cache.get_seq_length() == n
                fresh = DynamicCache(config=model.config)
                with torch.inference_mode():  # a fresh prefill of the committed prefix, then the same feed
                    model(torch.tensor([s.tokens[:n]]), **cache_kwarg(fresh), use_cache=True)
                    for kept, new in zip(cache.layers, fresh.layers):
                        torch.testing.assert_close(kept.keys, new.keys, atol=1e-5, rtol=0)
                        torch.testing.assert_close(kept.values, new.values, atol=1e-5, rtol=0)
                    want = model(torch.tensor([s.tokens[n:]]), **cache_kwarg(fresh), use_cache=True).logits[0, -1]
                    got = model(torch.tensor([s.tokens[n:]]), **cache_kwarg(cache), use_cache=True).logits[0, -1]
                torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=1e-5, rtol=0)
                assert got.argmax() == want.argmax()
            break  # the caches were advanced by the check; start a new session
    assert rollbacks >= 3


def test_step_reports(tiny_pair):
    s = new_bild_session(tiny_pair, random_prompt(3, 10), max_new_tokens=30)
    steps = []
    while not s.done:
        steps.append(s.step(0.103, 4.697))
    total = DecodeStats()
    total += s.prefill
    for step in steps:
        total += step
        assert step.steps == 1 and step.target_forwards >= 1 and step.wall_ms > 0
        assert step.draft_forwards == step.proposed + step.fallbacks
        assert step.proposed == step.accepted + step.discarded  # a draft token is kept or undone
    assert total.new_tokens == len(s.new_ids) == 30
    assert total.target_forwards == s.total.target_forwards and total.proposed == s.total.proposed
    summary = s.total.summary()
    assert summary["mean_accepted_length"] == pytest.approx(30 / s.total.target_forwards)
    assert 0 <= summary["overhead"] <= 1


def test_bad_input_is_refused_clearly_and_pair_stays_usable(tiny_pair):
    pair = tiny_pair
    ids = random_prompt(0, 5)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_target_only(pair, [], 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_bild(pair, "", max_new_tokens=4)
    with pytest.raises(ValueError, match="shorten the prompt"):
        generate_speculative(pair, random_prompt(0, pair.max_positions), 2, 4)
    with pytest.raises(ValueError, match="shorten the prompt"):
        generate_bild(pair, random_prompt(0, pair.max_positions - 3), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"fallback threshold must be a probability in \[0, 1\]"):
        generate_bild(pair, ids, fallback=1.2)
    with pytest.raises(ValueError, match="fallback"):
        generate_bild(pair, ids, fallback=-0.01)
    with pytest.raises(ValueError, match="rollback threshold"):
        generate_bild(pair, ids, rollback=-1.0)
    with pytest.raises(ValueError, match="rollback threshold"):
        generate_bild(pair, ids, rollback=float("nan"))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate_target_only(pair, ids, 0)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        generate_speculative(pair, ids, k=0)
    with pytest.raises(ValueError, match=r"confidence must be a probability in \[0, 1\]"):
        generate_speculative(pair, ids, k=3, confidence=1.5)
    with pytest.raises(ValueError, match="max_draft_len"):
        generate_bild(pair, ids, max_draft_len=0)
    with pytest.raises(ValueError, match="token ids must lie in"):
        generate_target_only(pair, [1, 10**7], 4)
    # infinity disables rollback: valid
    generate_bild(pair, ids, rollback=float("inf"), max_new_tokens=4)
    # still usable and still exact after all of that
    assert generate_speculative(pair, ids, 3, 10).new_ids == reference(pair, ids, 10)


def test_mismatched_vocabularies_are_refused(tmp_path, tiny_pair):
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=1000, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1, ffn_dim=32,
                       num_attention_heads=2, max_position_embeddings=64)
    OPTForCausalLM(config).save_pretrained(tmp_path / "small-vocab")
    target = tiny_pair.ids[1]
    with pytest.raises(PairError, match=r"vocabulary of 1000 tokens but the target .* has 50272"):
        load_pair(draft=tmp_path / "small-vocab", target=target, tokenizer=target.replace("target", "tokenizer"))


def test_missing_models_fail_with_one_clear_paragraph(tmp_path):
    with pytest.raises(PairError, match="Could not load the draft model") as info:
        load_pair(draft=tmp_path / "nope", target=tmp_path / "nope2", tokenizer=load_pair("tiny-random").ids[1].replace("target", "tokenizer"))
    assert "Presets that work offline" in str(info.value) and "tiny-random" in str(info.value)
    with pytest.raises(PairError, match="unknown model pair preset 'gpt5'"):
        load_pair("gpt5")


def test_pairs_are_loaded_once_per_process(tiny_pair):
    assert load_pair("tiny-random", device="cpu") is tiny_pair
    assert load_pair("tiny-random", device="cpu", dtype="float32") is tiny_pair


def test_forwards_bench_times_each_fed_count_beside_the_cost_model(tiny_pair, tmp_path):
    from bench import forwards

    from bild_env.decoding.costs import load_or_calibrate

    out = tmp_path / "forwards.json"
    forwards.main(["--pair", "tiny-random", "--device", "cpu", "--fed", "1,3", "--context", "5", "--repeats", "2",
                   "--out", str(out)])
    report = json.loads(out.read_text())
    cost = load_or_calibrate(tiny_pair)  # the one the bench read: calibrated once, then cached
    from bild_env.models.device import cpu_has_native_bf16

    both = cpu_has_native_bf16() is not False  # emulated bfloat16 (an AVX2-only CPU) is left out
    assert [run["dtype"] for run in report["runs"]] == ["torch.float32"] + ["torch.bfloat16"] * both
    rows = next(run["rows"] for run in report["runs"] if run["dtype"] == str(tiny_pair.dtype))
    assert [(r["model"], r["fed"], r["context"]) for r in rows] == [
        ("draft", 1, 5), ("draft", 3, 5), ("target", 1, 5), ("target", 3, 5)]
    for r in rows:
        assert r["measured_ms"] > 0 and r["cost_model_ms"] == pytest.approx(cost.ms(r["model"], r["fed"], r["context"]))
    with pytest.raises(SystemExit):
        forwards.main(["--pair", "tiny-random", "--fed", "1,two"])
    with pytest.raises(ValueError, match="lower --context or --fed"):
        forwards.run("tiny-random", (1, 2), tiny_pair.max_positions, 1, device="cpu")


def test_decode_stats_add_subtract_and_copy_every_field():
    from dataclasses import fields

    from bild_env.decoding.stats import DecodeStats

    a = DecodeStats(**{f.name: (i + 1) * (1.5 if f.type in ("float", "float | None") else 1)
                       for i, f in enumerate(fields(DecodeStats))})
    b = DecodeStats(**{f.name: i for i, f in enumerate(fields(DecodeStats))})
    diff, total, copy = a - b, a.copy(), a.copy()
    total += b
    for f in fields(DecodeStats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert getattr(diff, f.name) == x - y and getattr(total, f.name) == x + y and getattr(copy, f.name) == x
    assert copy is not a and copy == a and type(copy) is DecodeStats
    none = DecodeStats(model_ms=None)
    assert (a - none).model_ms is None and (none - a).model_ms is None
    none += a
    assert none.model_ms is None and none.new_tokens == a.new_tokens
