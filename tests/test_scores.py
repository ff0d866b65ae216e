"""The draft's stopping scores (``bild.DraftScore``): token, cumulative, oracle.

Hand-computed runs on a scripted runner; the lossless decoders stay exact in float32 with the cumulative score;
the batched decoder equals each request's ``BildSession`` under it; the oracle stops every run at its first
rejected token on the replay trees and is refused where it cannot be known (live decoding).
"""

from __future__ import annotations

import math

import pytest

from bild_env import generate_speculative, generate_target_only
from bild_env.decoding.batched import BatchedDecoder
from bild_env.decoding.bild import BildSession, DraftScore, check_score
from bild_env.decoding.decoders import new_bild_session, parse_adaptive, parse_stop_rule, stop_rule_name
from tests.test_batched_decoding import COUNTS, counts, random_prompt
from tests.test_bild_rules import ScriptedRunner


def test_draft_score_by_hand():
    token, cumulative, oracle = DraftScore("token"), DraftScore("cumulative"), DraftScore("oracle")
    for s in (token, cumulative, oracle):
        s.start()
    assert [token.next(p) for p in (0.9, 0.8, 0.7)] == [0.9, 0.8, 0.7]
    assert [cumulative.next(p) for p in (0.9, 0.8, 0.7)] == pytest.approx([0.9, 0.72, 0.504])
    assert [oracle.next(0.1, a) for a in (1.0, 1.0, 0.0, 1.0)] == [1.0, 1.0, 0.0, 0.0]
    cumulative.start()
    assert cumulative.next(0.5) == 0.5  # a run's first token is judged as by the token score
    with pytest.raises(ValueError, match="token, cumulative, lookup, lookup_cumulative, oracle"):
        check_score("product")
    half = DraftScore("oracle:0.5")  # between the max probability and the oracle, token by token
    half.start()
    assert [half.next(p, a) for p, a in ((0.9, 1.0), (0.2, 1.0), (0.8, 0.0))] == pytest.approx([0.95, 0.6, 0.4])
    one = DraftScore("oracle:1")
    one.start()
    assert [one.next(0.1, a) for a in (1.0, 0.0, 1.0)] == [1.0, 0.0, 0.0]  # stops as "oracle" does
    assert check_score("oracle:0.25") == "oracle"
    for bad in ("oracle:0", "oracle:1.5", "oracle:x", "token:0.5"):
        with pytest.raises(ValueError, match="oracle:W with W in"):
            check_score(bad)


def scripted(p_values: list[float]) -> ScriptedRunner:
    """Prompt [0]; the target commits 1 and then always prefers 0; the draft proposes 0 with these max probabilities
    along the run (so every proposal is kept)."""
    draft, prefix = {}, (0, 1)
    for p in p_values:
        draft[prefix] = (0, p)
        prefix += (0,)
    return ScriptedRunner(draft=draft, target={(0,): [0, 5, 0, 0, 0]})


@pytest.mark.parametrize("score, proposed, fallbacks", [("token", 4, 0), ("cumulative", 2, 1)])
def test_cumulative_stops_a_run_of_fairly_sure_tokens(score, proposed, fallbacks):
    # max probabilities 0.9, 0.8, 0.7, 0.9: none below 0.55, but 0.9 * 0.8 * 0.7 = 0.504 is
    session = BildSession(scripted([0.9, 0.8, 0.7, 0.9]), [0], max_new_tokens=10, max_draft_len=4, score=score)
    s = session.step(0.55, math.inf)
    assert (s.proposed, s.fallbacks, s.accepted, s.max_draft_hits) == (proposed, fallbacks, proposed, 1 - fallbacks)
    assert s.new_tokens == proposed + 1  # the kept drafts and the target's own token


def test_stop_rule_forms():
    assert parse_stop_rule("8:0.5") == (8, 0.5, "token")
    assert parse_stop_rule("12:0.2:cumulative") == (12, 0.2, "cumulative")
    assert parse_adaptive("8:0.5") == (8, 0.5)
    assert stop_rule_name(8, 0.2, "cumulative") == "naive SD (k<=8, cum<0.2)"
    for bad in ("8", "8:x", "0:0.5", "8:1.5", "8:0.5:oracle", "8:0.5:cumulative:1"):
        with pytest.raises(ValueError, match=r"K:F|K must be|names the score"):
            parse_stop_rule(bad)
    with pytest.raises(ValueError, match="token score"):
        parse_adaptive("8:0.2:cumulative")


@pytest.mark.parametrize("k, confidence", [(4, 0.3), (8, 0.6)])
def test_cumulative_naive_sd_is_lossless(agreeing_pair, k, confidence):
    for seed in range(3):
        prompt = random_prompt(seed, 5 + 3 * seed)
        reference = generate_target_only(agreeing_pair, prompt, 24).new_ids
        token = generate_speculative(agreeing_pair, prompt, k, 24, confidence=confidence)
        g = generate_speculative(agreeing_pair, prompt, k, 24, confidence=confidence, score="cumulative")
        assert g.new_ids == reference
        # the product is never above the last factor: the cumulative rule stops no later than the token rule
        assert g.stats.proposed / g.stats.steps <= token.stats.proposed / token.stats.steps + 1e-9


def test_batched_cumulative_equals_each_sessions(agreeing_pair):
    prompts = [random_prompt(10 + r, n) for r, n in enumerate((3, 9, 17))]
    decoder = BatchedDecoder(agreeing_pair, max_draft_len=6, score="cumulative")
    decoder.join(prompts, 20, [0, 1, 2])
    steps = {r: [] for r in range(3)}
    while len(decoder):
        for rid, s in decoder.step(0.4, 0.5).items():
            steps[rid].append(s)
    seen_fallbacks = 0
    for rid, prompt in enumerate(prompts):
        session = new_bild_session(agreeing_pair, prompt, 20, max_draft_len=6)
        session.score = DraftScore("cumulative")
        alone = []
        while not session.done:
            alone.append(session.step(0.4, 0.5))
        assert decoder.finished[rid].new_ids == session.new_ids == generate_target_only(agreeing_pair, prompt, 20).new_ids
        assert [counts(s, COUNTS) for s in steps[rid]] == [counts(s, COUNTS) for s in alone]
        seen_fallbacks += sum(s.fallbacks for s in alone)
    assert seen_fallbacks > 0


def test_oracle_is_refused_where_it_cannot_be_known(tiny_pair):
    with pytest.raises(ValueError, match="replay trees"):
        generate_speculative(tiny_pair, [1, 2, 3], 4, 8, confidence=0.5, score="oracle")
    with pytest.raises(ValueError, match="replay trees"):
        BatchedDecoder(tiny_pair, score="oracle")
    session = new_bild_session(tiny_pair, [1, 2, 3], 8)
    session.score = DraftScore("oracle")
    with pytest.raises(ValueError, match="replay"):
        session.step(0.5, 0.5)


ENV_DEFAULTS = {"backend": "replay"}


def test_env_oracle_keeps_every_proposal(make_env):
    totals = {}
    for score in ("token", "cumulative", "oracle", "oracle:0.5"):
        env = make_env(actions={"score": score}, max_new_tokens=24)
        proposed = accepted = 0
        for seed in range(3):
            env.reset(seed=seed)
            done = False
            while not done:
                _, _, terminated, truncated, info = env.step(12)  # a middle fallback threshold, rollback off or not
                proposed += info["proposed"]
                accepted += info["accepted"]
                done = terminated or truncated
        totals[score] = (proposed, accepted)
    proposed, accepted = totals["oracle"]
    assert proposed > 0 and accepted == proposed  # a perfect predictor drafts only what the target keeps
    assert totals["token"][1] < totals["token"][0]
    # half way: at fallback 0.35 (action 12) a rejected proposal of max probability below 0.7 stops the run, and an
    # accepted one never does: more kept per proposal than the max probability alone, fewer than the oracle
    assert totals["token"][1] / totals["token"][0] < totals["oracle:0.5"][1] / totals["oracle:0.5"][0] <= 1.0


def test_env_refuses_a_live_oracle_and_an_unknown_score(make_env):
    for oracle in ("oracle", "oracle:0.5"):
        with pytest.raises(ValueError, match="backend='replay'"):
            make_env(actions={"score": oracle}, backend="live")
    with pytest.raises(ValueError, match="token, cumulative, lookup, lookup_cumulative, oracle"):
        make_env(actions={"score": "best"})
