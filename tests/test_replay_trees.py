"""Tree steps answered from the replay trees (``ReplayRunner.grow_tree`` / ``verify_tree`` / ``keep_path``) give exactly
what the live ``TreeRunner`` gives: the tokens, every counter, and the forwards charged, alone and between BiLD steps."""

from __future__ import annotations

import numpy as np
import pytest

from bild_env.decoding.bild import BildSession
from bild_env.decoding.tree import TreeRunner, parse_tree_rule, session_tree_step
from bild_env.env import BildEnv
from bild_env.reference import ReferenceStore
from bild_env.replay import ReplayRunner, TreeStore

from conftest import COSTS, assert_same_up_to_regret_rounding  # noqa: E402

RULES = ("6:8:2:0.3", "3,2,1,1", "12:4:3", "1,1,1")
COUNTS = ("steps", "proposed", "accepted", "full_accepts", "draft_forwards", "target_forwards", "draft_tokens_fed",
          "target_tokens_fed", "new_tokens")


def env(**kwargs):
    return BildEnv(**({"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 24,
                       "reward": {"quality": "bleu"}, "actions": {"tree_rules": RULES}} | kwargs))


def episodes(e, seeds, rng, tree_share=0.5):
    """One episode per seed; each step a tree action with probability ``tree_share``, else a grid action."""
    out = []
    n_grid, first = 25, e.first_tree
    for seed in seeds:
        obs, info = e.reset(seed=seed)
        out.append((obs.tolist(), info))
        done = False
        while not done:
            a = first + int(rng.integers(len(RULES))) if rng.random() < tree_share else int(rng.integers(n_grid))
            obs, r, term, trunc, info = e.step(a)
            out.append((obs.tolist(), r, term, trunc, info))
            done = term or trunc
        out.append(tuple(e.session.new_ids))
    return out


def test_replay_tree_steps_equal_live_ones_in_the_env(tiny_pair):
    """BiLD-v1 on replay with tree_rules: observations, rewards (latency charged by the cost model) and infos equal the
    live env's over random tree and grid actions; the same episodes again need no model forward."""
    live, replay = env(), env(backend="replay", replay_store=TreeStore())
    seeds = range(8)
    a = episodes(live, seeds, np.random.default_rng(0))
    b = episodes(replay, seeds, np.random.default_rng(0))
    assert_same_up_to_regret_rounding(a, b)
    assert sum(1 for row in b if len(row) == 5 and row[4].get("tree")) > 20
    cold = replay.runner.store.report()
    assert episodes(replay, seeds, np.random.default_rng(0)) == b
    warm = replay.runner.store.report()
    assert warm["fills"] == cold["fills"] and warm["misses"] == cold["misses"] and warm["hits"] > cold["hits"]


@pytest.mark.parametrize("rule", RULES)
def test_replay_session_tree_steps_equal_live_ones(tiny_pair, rule):
    """Tree steps alone on a session: the same tokens, counters and charged forwards (the trace of (role, fed,
    context)) as a live TreeRunner, from a cold store and again from a warm one."""
    parsed = parse_tree_rule(rule)
    store = TreeStore()
    references = ReferenceStore(tiny_pair, 20)
    for prompt in ([5, 17, 3, 99, 42], list(range(10, 40))):
        live = BildSession(TreeRunner(tiny_pair, COSTS), prompt, 20, tiny_pair.eos_token_ids, 8)
        live_trace = []
        while not live.done:
            before = live.runner.stats.copy()
            session_tree_step(live, parsed)
            live_trace.append((live.runner.stats.draft_tokens_fed - before.draft_tokens_fed,
                               live.runner.stats.target_tokens_fed - before.target_tokens_fed))
        for _ in range(2):  # cold, then warm
            runner = ReplayRunner(tiny_pair, COSTS, references, 20, store=store)
            runner.trace = []
            replay = BildSession(runner, prompt, 20, tiny_pair.eos_token_ids, 8)
            replay_trace = []
            while not replay.done:
                before = runner.stats.copy()
                session_tree_step(replay, parsed)
                replay_trace.append((runner.stats.draft_tokens_fed - before.draft_tokens_fed,
                                     runner.stats.target_tokens_fed - before.target_tokens_fed))
            assert replay.tokens == live.tokens
            assert replay_trace == live_trace
            assert {f: getattr(replay.total, f) for f in COUNTS} == {f: getattr(live.total, f) for f in COUNTS}
            assert replay.total.model_ms == pytest.approx(live.total.model_ms)
            assert runner.lengths == live.runner.lengths


def test_replay_tree_step_fills_only_on_a_miss(tiny_pair):
    """A cold tree step fills the draft's candidates level by level and the target's choices once; the same step
    again is answered from the prefix tree alone."""
    store = TreeStore()
    references = ReferenceStore(tiny_pair, 16)
    rule = parse_tree_rule("3,2,1")
    prompt = [7, 8, 9, 10]

    def one_step():
        runner = ReplayRunner(tiny_pair, COSTS, references, 16, store=store)
        session = BildSession(runner, prompt, 16, tiny_pair.eos_token_ids, 8)
        session_tree_step(session, rule)
        return session.tokens

    before = store.counts.fills
    first = one_step()
    cold = store.counts.fills - before
    assert cold >= 2  # the warm start's two (draft, target along the reference) and at least one tree fill
    again = store.counts.fills
    assert one_step() == first and store.counts.fills == again
