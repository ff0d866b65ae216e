"""Observations that foresee: the draft's score for the next proposal, read ahead from the replay trees.

BiLD-v1 ``observation="foresee"`` (entry 17) and BiLD-Serve-v0 ``observe_next`` (3 entries): the value read ahead
is the one the next step's first draft forward computes (a step whose fallback threshold is above it falls back
at once, one below it drafts), reading it charges nothing (same rewards as without it), and it is refused where
it cannot be read (live decoding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bild_env.serving.observations import foresight
from tests.test_serving import make_serve, workload  # noqa: F401  (fixtures)

ENV_DEFAULTS = {"backend": "replay"}
N_ROLLBACK = 5


def action(fallback_index: int, rollback_index: int = 0) -> int:
    return fallback_index * N_ROLLBACK + rollback_index


def test_next_proposal_score_is_what_the_next_step_reads(make_env):
    env = make_env(observation="foresee")
    assert env.observation_space.shape == (18,)
    fallbacks = env.unwrapped.config.actions.fallback_values
    seen_low = seen_high = 0
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        done, t = False, 0
        while not done:
            assert env.observation_space.contains(obs)
            p_next = float(obs[17])
            above = [i for i, f in enumerate(fallbacks) if f > p_next + 1e-6]
            below = [i for i, f in enumerate(fallbacks) if f < p_next - 1e-6]
            low = bool(above) and (t % 2 == 0 or not below)
            i = above[0] if low else below[-1] if below else 0
            obs, _, terminated, truncated, info = env.step(action(i))
            if low:  # the first proposal is below the threshold: withheld at once
                assert info["proposed"] == 0 and info["fell_back"]
                seen_low += 1
            elif below:  # it is above: the run drafts it
                assert info["proposed"] >= 1
                seen_high += 1
            done, t = terminated or truncated, t + 1
    assert seen_low > 0 and seen_high > 0


def test_reading_ahead_charges_nothing(make_env):
    plain, ahead = make_env(observation="context"), make_env(observation="foresee")
    for seed in range(2):
        a, _ = plain.reset(seed=seed)
        b, _ = ahead.reset(seed=seed)
        np.testing.assert_array_equal(a, b[:17])
        for t in range(40):
            act = (7 * t + seed) % 25
            a, ra, ta, tra, _ = plain.step(act)
            b, rb, tb, trb, _ = ahead.step(act)
            assert ra == rb and (ta, tra) == (tb, trb)
            np.testing.assert_array_equal(a, b[:17])
            if ta or tra:
                break


def test_foresee_needs_the_replay_trees(make_env):
    with pytest.raises(ValueError, match="backend='replay'"):
        make_env(observation="foresee", backend="live")


def test_foresight_by_hand():
    assert foresight([], 0.3) == [1.0, 0.0, 1.0]
    mean, spread, share = foresight([0.2, 0.4, 0.9, 0.5], 0.45)
    assert mean == pytest.approx(0.5) and share == 0.5
    assert spread == pytest.approx(2 * np.std([0.2, 0.4, 0.9, 0.5]))


def test_serving_observes_the_next_proposals_at_no_charge(make_serve):
    plain, ahead = make_serve(), make_serve(observe={"next": True})
    assert ahead.observation_space.shape == (plain.observation_space.shape[0] + 3,)
    a, _ = plain.reset(seed=3)
    b, _ = ahead.reset(seed=3)
    n = plain.observation_space.shape[0]
    np.testing.assert_array_equal(a, b[:n])
    spreads = []
    for t in range(12):
        act = (5 * t + 2) % 26  # the grid and, now and then, speculation off (25)
        a, ra, _, _, ia = plain.step(act)
        b, rb, _, _, ib = ahead.step(act)
        assert ra == rb and ia["step_ms"] == ib["step_ms"]
        np.testing.assert_array_equal(a, b[:n])
        assert ahead.observation_space.contains(b)
        envu = ahead.unwrapped
        running = [r for r in envu.active if not r.session.done]
        assert b[n] == pytest.approx(np.mean(envu.view.next_p) if running else 1.0, abs=1e-6)
        assert len(envu.view.next_p) == len(running)
        spreads.append(float(b[n + 1]))
    assert max(spreads) > 0


def test_an_agent_that_foresees_is_evaluated_in_an_env_that_does():
    from gymnasium import spaces

    from agents.serve.evaluation_agents import GRID, check_spaces
    from bild_env.serving.env import ServingConfig
    from bild_env.serving.observations import N_BASE, N_FORESEE

    assert "next" in GRID["observe"] and "score" in GRID["actions"]  # an agent's run folder sets them in its env
    saved = {"observation_space": spaces.Box(0, 1, (N_BASE + N_FORESEE,)), "action_space": spaces.Discrete(26)}
    check_spaces("run", Path("m.zip"), saved, ServingConfig(observe={"next": True}), True)
    with pytest.raises(ValueError, match="observation space"):
        check_spaces("run", Path("m.zip"), saved, ServingConfig(), True)


def test_batched_decoder_reads_the_next_proposals_ahead_at_no_extra_forward(tiny_pair):
    """``BatchedDecoder.peek_draft`` is the draft's max probability after each running request's tokens (computed
    here with one plain forward per request), and reading ahead changes nothing but when the forward runs: a
    decoder that peeks (twice before some steps, before an off step, before a join) commits the same tokens with the
    same counts as one that never does, in exactly as many draft forwards."""
    import torch

    from bild_env.decoding.batched import BatchedDecoder

    prompts = [[5 + i, 17, 23 + 3 * i, 40][: 2 + i] for i in range(4)]
    plain, peeking = BatchedDecoder(tiny_pair, max_draft_len=4), BatchedDecoder(tiny_pair, max_draft_len=4)
    assert peeking.peek_draft() == []
    for d in (plain, peeking):
        d.join(prompts[:3], [10, 7, 12], ["a", "b", "c"])
        d.forward_log = []
    peeked, t = 0, 0
    while len(plain):
        assert plain.ids == peeking.ids
        p = peeking.peek_draft()
        if t % 3 == 1:
            assert peeking.peek_draft() == p  # read ahead already: no forward, the same values
        for row, value in enumerate(p):
            ids = peeking.tokens[row, : int(peeking.lens[row])][None]
            with torch.inference_mode():
                logits = tiny_pair.draft(input_ids=ids).logits[0, -1].float()
            assert value == pytest.approx(float(torch.softmax(logits, -1).max()), abs=1e-4)
            peeked += 1
        if t == 2:  # a request joins after the read-ahead: it is read in the step's own forward
            for d in (plain, peeking):
                d.join([prompts[3]], 9, ["d"])
        a, b = plain.step(0.3, 0.5), peeking.step(0.3, 0.5)
        assert {r: (s.new_tokens, s.draft_forwards, s.draft_tokens_fed, s.target_forwards) for r, s in a.items()} == \
            {r: (s.new_tokens, s.draft_forwards, s.draft_tokens_fed, s.target_forwards) for r, s in b.items()}
        t += 1
    assert peeked > 3
    assert {r: g.new_ids for r, g in plain.finished.items()} == {r: g.new_ids for r, g in peeking.finished.items()}
    drafts = [sum(f.role == "draft" for f in d.forward_log) for d in (plain, peeking)]
    assert drafts[0] == drafts[1] > 0  # no forward run twice

    # a step that turns speculation off after a read-ahead wastes that forward (its cache entries stay valid)
    plain, peeking = BatchedDecoder(tiny_pair, max_draft_len=4), BatchedDecoder(tiny_pair, max_draft_len=4)
    for d in (plain, peeking):
        d.join(prompts[:2], 8, ["a", "b"])
        d.forward_log = []
    for off in (False, True, False, True, True, False, False, False):
        if len(plain):
            peeking.peek_draft()
            plain.step(0.3, 0.5, off=off), peeking.step(0.3, 0.5, off=off)
    assert {r: g.new_ids for r, g in plain.finished.items()} == {r: g.new_ids for r, g in peeking.finished.items()}


def test_reading_ahead_is_charged_on_a_step_that_drafts_nothing(make_serve):
    """With ``observe_next`` a server reads the next proposals with the step's first draft forward, before the
    action: a step that then drafts nothing (speculation off) pays that forward, so it earns less than target-only
    serving (0); a step that drafts uses it and is charged as without the read-ahead."""
    import numpy as np

    off, spec = 25, 15
    rewards = {}
    for foresee in (False, True):
        env = make_serve(observe={"next": foresee}, episode_steps=8)
        env.reset(seed=3)
        first = env.step(spec)[1]  # the first step: nothing read ahead yet
        rewards[foresee] = (first, [env.step(off)[1] for _ in range(6)])
    assert rewards[True][0] == rewards[False][0]
    assert np.allclose(rewards[False][1], 0.0, atol=1e-12)
    assert all(r < 0 for r in rewards[True][1])


def test_reading_ahead_only_up_to_a_batch_size(make_serve):
    """``read_ahead_batch``: the next proposals are read (and a step drafting nothing charged for them) only while
    the running batch holds at most that many requests; above, the entries read as for an empty batch, free."""
    env = make_serve(observe={"next": True}, charging={"read_ahead_batch": 1}, episode_steps=8, load="constant:1.0")
    obs, _ = env.reset(seed=3)
    seen = 0
    for _ in range(8):
        running = len([r for r in env.unwrapped.active if not r.session.done])
        if running > 1:
            assert list(obs[-3:]) == [1.0, 0.0, 1.0] and env.unwrapped.view.next_p == []
            seen += 1
        obs, reward, _, truncated, _ = env.step(25)  # off
        if running > 1:
            assert reward == 0.0  # nothing was read ahead, nothing charged
        if truncated:
            break
    assert seen > 0
    with pytest.raises(ValueError, match="read_ahead_batch must be an integer >= 0"):
        make_serve(observe={"next": True}, charging={"read_ahead_batch": -1})
