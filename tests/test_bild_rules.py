"""BiLD's fallback and rollback decisions on small hand-built distributions, counters checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from bild_env.decoding.bild import BildSession, first_rollback, should_fall_back
from bild_env.decoding.stats import DecodeStats

VOCAB = 5
DEFAULT_TARGET = [5.0, 0.0, 0.0, 0.0, 0.0]  # target argmax 0, unless a prefix says otherwise


class ScriptedRunner:
    """A runner whose models are tables: prefix -> draft (token, max prob), prefix -> target logits."""

    def __init__(self, draft: dict[tuple, tuple[int, float]], target: dict[tuple, list[float]]) -> None:
        self.draft, self.target = draft, target
        self.start()

    def start(self) -> None:
        self.stats = DecodeStats()
        self.lengths = {"draft": 0, "target": 0}

    def draft_next(self, tokens: list[int]) -> tuple[int, float]:
        self.stats.draft_forwards += 1
        self.stats.draft_tokens_fed += len(tokens) - self.lengths["draft"]
        self.lengths["draft"] = len(tokens)
        return self.draft[tuple(tokens)]

    def target_verify(self, tokens: list[int]) -> tuple[list[int], list[float], list[float]]:
        start = self.lengths["target"]
        self.stats.target_forwards += 1
        self.stats.target_tokens_fed += len(tokens) - start
        self.lengths["target"] = len(tokens)
        argmax, logp, top = [], [], []
        for p in range(start, len(tokens)):
            z = torch.tensor(self.target.get(tuple(tokens[: p + 1]), DEFAULT_TARGET), dtype=torch.float64)
            argmax.append(int(z.argmax()))
            if p + 1 < len(tokens):
                logp.append(float(torch.log_softmax(z, -1)[tokens[p + 1]]))
                top.append(float(torch.log_softmax(z, -1).max()))
        return argmax, logp, top

    def crop(self, n: int) -> None:
        for role in self.lengths:
            self.lengths[role] = min(self.lengths[role], n)


def distance(logits: list[float], token: int) -> float:
    """-log softmax(logits)[token], by hand."""
    return math.log(sum(math.exp(v) for v in logits)) - logits[token]


def test_pure_rules():
    assert should_fall_back(0.05, 0.103) and not should_fall_back(0.2, 0.103)
    assert not should_fall_back(0.0, 0.0)  # threshold 0 never falls back
    assert should_fall_back(0.999, 1.0)  # threshold 1 always does
    # distance above the threshold but the token IS the target's argmax: not rolled back, and the
    # next token is still checked (BiLD's reference code would stop checking here).
    assert first_rollback([5.0, 5.0], [3, 1], [3, 2], 4.0) == 1
    assert first_rollback([5.0, 3.0], [3, 1], [3, 2], 4.0) is None
    assert first_rollback([4.1], [1], [2], 4.0) == 0
    assert first_rollback([4.0], [1], [2], 4.0) is None  # strictly greater


def test_rollback_at_first_draft_token_after_fallback():
    # prompt [0]; target prefill commits 1.
    # draft after [0,1] -> 2 (p .9), after [0,1,2] -> 3 (p .8), after [0,1,2,3] -> p .05: fallback.
    # target at [0,1] gives token 2 distance 8.02 > 4.697 and prefers 4: rollback at the first draft
    # token; tokens -> [0,1,4]; then one more target forward emits its argmax after [0,1,4] (= 0).
    z01 = [0.0, 0.0, -3.0, 0.0, 5.0]
    assert distance(z01, 2) == pytest.approx(8.0203, abs=1e-3)
    runner = ScriptedRunner(
        draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.8), (0, 1, 2, 3): (1, 0.05)},
        target={(0,): [0, 5, 0, 0, 0], (0, 1): z01},
    )
    s = BildSession(runner, [0], max_new_tokens=10)
    assert s.tokens == [0, 1]
    step = s.step(0.103, 4.697)
    assert s.tokens == [0, 1, 4, 0]
    assert (step.proposed, step.accepted, step.fallbacks, step.max_draft_hits) == (2, 0, 1, 0)
    assert (step.rollbacks, step.discarded, step.full_accepts, step.new_tokens) == (1, 2, 0, 2)
    # draft: fed [0,1], [2], [3]; target: fed [1,2,3] then the correction [4]
    assert (step.draft_forwards, step.draft_tokens_fed) == (3, 4)
    assert (step.target_forwards, step.target_tokens_fed) == (2, 4)
    assert runner.lengths == {"draft": 2, "target": 3}
    assert s.total.new_tokens == 3 and s.total.target_forwards == 3  # prefill included


def test_rollback_at_last_draft_token_at_max_draft_len():
    # draft proposes 2, 3, 4 confidently; max_draft_len=3 ends the run. The target agrees on 2 and 3
    # but gives 4 a distance of 6.01 (> 4.697) and prefers 1: rollback at the last draft token.
    z = [0.0, 6.0, 0.0, 0.0, 0.0]
    runner = ScriptedRunner(
        draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.9), (0, 1, 2, 3): (4, 0.9)},
        target={(0,): [0, 5, 0, 0, 0], (0, 1): [0, 0, 5, 0, 0], (0, 1, 2): [0, 0, 0, 5, 0], (0, 1, 2, 3): z},
    )
    s = BildSession(runner, [0], max_new_tokens=10, max_draft_len=3)
    step = s.step(0.5, 4.697)
    assert distance(z, 4) > 4.697
    assert s.tokens == [0, 1, 2, 3, 1, 0]
    assert (step.proposed, step.accepted, step.max_draft_hits, step.fallbacks) == (3, 2, 1, 0)
    assert (step.rollbacks, step.discarded, step.new_tokens) == (1, 1, 4)
    assert (step.target_forwards, step.target_tokens_fed) == (2, 5)  # [1,2,3,4] then [1]


def test_full_acceptance_commits_target_token_and_low_threshold_is_exact():
    # a flat-ish target: draft token 3 has p_L = 0.3 (distance 1.2) while the argmax is 2 (p .4).
    z = [math.log(0.1), math.log(0.1), math.log(0.4), math.log(0.3), math.log(0.1)]
    table = {(0,): [0, 5, 0, 0, 0], (0, 1): z}
    draft = {(0, 1): (3, 0.9), (0, 1, 3): (0, 0.01), (0, 1, 2): (0, 0.01)}
    # rollback 4.697: distance 1.2 is tolerated, the draft token stays; the target adds its token 0.
    s = BildSession(ScriptedRunner(draft, table), [0], max_new_tokens=10)
    step = s.step(0.103, 4.697)
    assert s.tokens == [0, 1, 3, 0]
    assert (step.accepted, step.full_accepts, step.rollbacks, step.fallbacks) == (1, 1, 0, 1)
    # rollback below ln 2: every token that differs from the argmax is corrected (exact BiLD).
    s = BildSession(ScriptedRunner(draft, table), [0], max_new_tokens=10)
    step = s.step(0.103, 0.5)
    assert s.tokens == [0, 1, 2, 0]
    assert (step.accepted, step.rollbacks, step.discarded) == (0, 1, 1)


def test_fallback_threshold_zero_and_one():
    draft = {(0, 1): (1, 0.0001), (0, 1, 1): (1, 0.0001), (0, 1, 1, 1): (1, 0.0001)}
    target = {(0,): [0, 5, 0, 0, 0], (0, 1): [0, 5, 0, 0, 0], (0, 1, 1): [0, 5, 0, 0, 0]}
    s = BildSession(ScriptedRunner(draft, target), [0], max_new_tokens=10, max_draft_len=2)
    step = s.step(0.0, 4.697)  # 0 is a valid threshold: never fall back, even at p = 1e-4
    assert (step.proposed, step.fallbacks, step.max_draft_hits) == (2, 0, 1)
    s = BildSession(ScriptedRunner(draft, target), [0], max_new_tokens=10, max_draft_len=2)
    step = s.step(1.0, 4.697)  # 1 always falls back: the target decodes alone
    assert (step.proposed, step.fallbacks, step.new_tokens, step.draft_forwards) == (0, 1, 1, 1)


def test_max_new_tokens_and_eos_end_the_session():
    draft = {(0, 1): (2, 0.9), (0, 1, 2): (3, 0.9)}
    target = {(0,): [0, 5, 0, 0, 0], (0, 1): [0, 0, 5, 0, 0], (0, 1, 2): [0, 0, 0, 5, 0]}
    s = BildSession(ScriptedRunner(draft, target), [0], max_new_tokens=3)
    s.step(0.1, 4.0)
    assert s.tokens == [0, 1, 2, 3] and s.done  # stops drafting at the limit, adds no target token
    with pytest.raises(RuntimeError, match="finished"):
        s.step(0.1, 4.0)
    # EOS (token 3) proposed by the draft and accepted ends the generation too
    s = BildSession(ScriptedRunner(draft, target), [0], max_new_tokens=10, eos_token_ids=[3])
    s.step(0.1, 4.0)
    assert s.tokens == [0, 1, 2, 3] and s.done


@pytest.mark.parametrize("fallback,rollback", [(-0.1, 1.0), (1.5, 1.0), (float("nan"), 1.0), (0.1, -1.0), (0.1, float("nan"))])
def test_bad_thresholds(fallback, rollback):
    s = BildSession(ScriptedRunner({}, {}), [0], max_new_tokens=4)
    with pytest.raises(ValueError, match="threshold"):
        s.step(fallback, rollback)


def test_regret_and_fidelity_of_kept_tokens_by_hand():
    # Same tables as the first rollback test, but rollback 9 nats keeps draft token 2 (distance 8.02,
    # target prefers 4): one mismatch, regret = log p(4) - log p(2) = 5 - (-3) = 8 nats exactly. Draft
    # token 3 equals the target's argmax after [0,1,2] (z012), so it costs nothing, nor does the
    # target's own token after the draft run.
    z01 = [0.0, 0.0, -3.0, 0.0, 5.0]
    z012 = [0.0, 0.0, 0.0, 5.0, 0.0]  # the target agrees with draft token 3
    runner = ScriptedRunner(
        draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.8), (0, 1, 2, 3): (1, 0.05)},
        target={(0,): [0, 5, 0, 0, 0], (0, 1): z01, (0, 1, 2): z012},
    )
    s = BildSession(runner, [0], max_new_tokens=10)
    step = s.step(0.103, 9.0)
    assert s.tokens == [0, 1, 2, 3, 0]  # both draft tokens kept, then the target's argmax after [0,1,2,3]
    assert (step.accepted, step.rollbacks, step.mismatches) == (2, 0, 1)
    assert step.regret == pytest.approx(8.0, abs=1e-12)
    assert step.fidelity == pytest.approx(1 - 1 / 3) and step.regret_per_token == pytest.approx(8.0 / 3)
    # a threshold below ln 2 rolls the mismatch back instead: nothing kept against the target, regret 0
    runner = ScriptedRunner(
        draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.8), (0, 1, 2, 3): (1, 0.05)},
        target={(0,): [0, 5, 0, 0, 0], (0, 1): z01, (0, 1, 2): z012},
    )
    s = BildSession(runner, [0], max_new_tokens=10)
    step = s.step(0.103, 0.5)
    assert (step.rollbacks, step.mismatches, step.regret, step.fidelity) == (1, 0, 0.0, 1.0)


def test_draft_predictions_judged_by_the_verification_by_hand():
    """The counts behind the "context" observation: every proposed token up to a rollback, and a withheld one."""
    def judged(step: DecodeStats) -> tuple:
        return step.guesses, step.guesses_right, round(step.guess_p, 6), step.low_guesses, step.low_guesses_right

    # rollback at the first of two proposals: only that one (wrong: the target wants 4) is judged; the
    # prediction the fallback withheld sat after a rolled-back token, so it is not.
    runner = ScriptedRunner(draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.8), (0, 1, 2, 3): (1, 0.05)},
                            target={(0,): [0, 5, 0, 0, 0], (0, 1): [0.0, 0.0, -3.0, 0.0, 5.0]})
    assert judged(BildSession(runner, [0], max_new_tokens=10).step(0.103, 4.697)) == (1, 0, 0.9, 0, 0)
    # three proposals at max_draft_len, the last rolled back: 2 right, 1 wrong, none withheld
    runner = ScriptedRunner(draft={(0, 1): (2, 0.9), (0, 1, 2): (3, 0.9), (0, 1, 2, 3): (4, 0.9)},
                            target={(0,): [0, 5, 0, 0, 0], (0, 1): [0, 0, 5, 0, 0], (0, 1, 2): [0, 0, 0, 5, 0],
                                    (0, 1, 2, 3): [0.0, 6.0, 0.0, 0.0, 0.0]})
    assert judged(BildSession(runner, [0], max_new_tokens=10, max_draft_len=3).step(0.5, 4.697)) == (3, 2, 2.7, 0, 0)
    # a kept proposal that is not the target's argmax (wrong), then a withheld low-confidence one the
    # target's next token confirms (right, and low)
    z = [math.log(0.1), math.log(0.1), math.log(0.4), math.log(0.3), math.log(0.1)]
    runner = ScriptedRunner({(0, 1): (3, 0.9), (0, 1, 3): (0, 0.01)}, {(0,): [0, 5, 0, 0, 0], (0, 1): z})
    session = BildSession(runner, [0], max_new_tokens=10)
    assert judged(session.step(0.103, 4.697)) == (2, 1, 0.91, 1, 1) and judged(session.total) == (2, 1, 0.91, 1, 1)
