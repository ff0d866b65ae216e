"""Token-tree rules as actions of the batch-1 env (``tree_rules``): the spaces, exactness against target-only greedy
decoding, caches kept consistent when BiLD steps and tree steps alternate, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from bild_env import generate_target_only
from bild_env.decoding.bild import BildSession
from bild_env.decoding.runner import LiveRunner
from bild_env.decoding.tree import TreeRunner, generate_tree, parse_tree_rule, session_tree_step
from bild_env.env import EnvConfig, validate
from bild_env.models.compat import cache_kwarg

from conftest import COSTS  # noqa: E402

RULES = ("6:8:2:0.3", "3,2,1,1")
ENV_DEFAULTS = {"actions": {"tree_rules": RULES}, "max_new_tokens": 20}  # BiLD-v0 (conftest's make_env): a 25-action grid
COUNTS = ("steps", "proposed", "accepted", "full_accepts", "draft_forwards", "target_forwards", "draft_tokens_fed",
          "target_tokens_fed", "new_tokens")


def play(env, actions):
    """One step per action (cycled) until the episode ends; each step's (action, reward, info, tokens before it)."""
    out = []
    for a in itertools.cycle(actions):
        before = list(env.session.tokens)
        _, reward, term, trunc, info = env.step(a)
        assert not trunc, info
        out.append((a, reward, info, before))
        if term:
            return out


def assert_caches_hold_committed_tokens(env):
    """Both caches hold committed tokens only: their keys and values equal a fresh forward's over those tokens."""
    from transformers import DynamicCache

    runner, tokens = env.runner, env.session.tokens
    for role in ("draft", "target"):
        model, cache, n = getattr(env.pair, role), runner.caches[role], runner.lengths[role]
        assert cache.get_seq_length() == n and runner.columns[role] == []
        assert n <= len(tokens) - 1 or env.session.done  # the last token committed is never fed before the next step
        fresh = DynamicCache(config=model.config)
        model(torch.tensor([tokens[:n]]), **cache_kwarg(fresh), use_cache=True)
        for a, b in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def test_check_env_passes_and_each_rule_is_one_more_action(make_env):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    env = make_env()
    gym_check(env.unwrapped, skip_render_check=True)
    sb3_check(env.unwrapped, warn=True)
    assert env.action_space.n == 25 + 2 and isinstance(env.unwrapped.runner, TreeRunner)
    off = make_env(actions={"off_switch": True}).unwrapped
    assert off.action_space.n == 25 + 1 + 2
    assert [off.tree_rule(a) for a in (0, 24, 25, 26, 27)] == [None, None, None, "6:8:2:0.3", "3,2,1,1"]
    assert off.thresholds(25) is None and off.thresholds(7) == (0.103, 4.697)
    assert off.tree_action("3,2,1,1") == 27 and off.tree_action("6:8:2:0.30") == 26  # the same rule, other text
    with pytest.raises(ValueError, match="not one of the env's tree_rules"):
        off.tree_action("2,2")
    with pytest.raises(ValueError, match=r"\[0, 28\).*25 = speculation off; 26-27 = the tree rules"):
        off.step(28)
    plain = make_env(actions={"tree_rules": ()}).unwrapped  # the default: the env as it was
    assert plain.action_space.n == 25 and type(plain.runner) is LiveRunner


@pytest.mark.parametrize("rule", RULES)
def test_an_episode_of_one_tree_rule_is_generate_tree(make_env, rule):
    """Tree actions only: target-only greedy decoding's tokens, and generate_tree's counts and cost-model time; each
    step one target forward, the path and the target's own token committed, rewarded as a BiLD step is."""
    env = make_env().unwrapped
    action = env.tree_action(rule)
    for i in range(3):
        env.reset(options={"prompt_index": i})
        steps = play(env, [action])
        prompt = env.prompts[i]
        g = generate_tree(env.pair, prompt, rule, 20, COSTS)
        assert env.session.new_ids == g.new_ids == generate_target_only(env.pair, prompt, 20).new_ids
        total = env.session.total
        assert {f: getattr(total, f) for f in COUNTS} == {f: getattr(g.stats, f) for f in COUNTS}
        assert total.model_ms == pytest.approx(g.stats.model_ms)
        infos = [info for _, _, info, _ in steps]
        if rule == "3,2,1,1":  # by hand: 3 + 6 + 6 + 6 nodes, grown in 4 draft forwards, verified in one target forward
            assert (infos[0]["proposed"], infos[0]["draft_forwards"], infos[0]["target_forwards"]) == (21, 4, 1)
        assert all(info["tree"] == rule and not info["off"] and info["target_forwards"] == 1 and info["regret"] == 0
                   and (info["fallback"], info["rollback"]) == (0.0, 0.0) for info in infos)
        assert [info["committed"] for info in infos[:-1]] == [info["accepted"] + 1 for info in infos[:-1]]
        assert sum(info["committed"] for info in infos) == len(env.session.new_ids) - 1  # the prefill made one
        for _, reward, info, before in steps:
            ref = COSTS.target_only_ms(len(before), info["committed"])
            assert reward == pytest.approx((ref - info["latency_ms"]) / env.norm_ms)
        assert infos[-1]["episode_summary"]["fidelity"] == 1.0


def test_tree_steps_between_off_steps_are_target_greedy(make_env):
    env = make_env(actions={"off_switch": True}, max_new_tokens=24).unwrapped
    off, trees = 25, (26, 27)
    seen = set()
    for i in range(3):
        env.reset(options={"prompt_index": i})
        steps = play(env, [trees[0], off, trees[1], off, off, trees[0], trees[1]])
        assert env.session.new_ids == generate_target_only(env.pair, env.prompts[i], 24).new_ids
        for a, _, info, _ in steps:
            seen.add(a)
            if a == off:
                assert info["off"] and info["tree"] is None and info["committed"] == 1 and info["draft_forwards"] == 0
            else:
                assert info["tree"] == RULES[a - 26] and not info["off"]
        assert_caches_hold_committed_tokens(env)
    assert seen == {off, *trees}


def test_bild_steps_and_tree_steps_keep_the_caches_consistent(make_env):
    """Lossy BiLD steps (rollbacks cropping both caches) between tree steps: after every step both caches hold the
    committed tokens only; every tree step commits the target's greedy continuation of the tokens before it (a fresh
    target-only decode of that prefix); and a fresh BildSession on a fresh TreeRunner, driven by the same steps,
    commits the same tokens with the same counts."""
    env = make_env(max_new_tokens=24).unwrapped
    # BiLD-v0's grid: 0 = (0.03, 1.0), 7 = (0.103, 4.697), 12 = (0.2, 4.697), 24 = (0.6, 8.0); then the two trees
    actions = [0, 25, 7, 26, 24, 12, 25, 0, 26]
    rolled_back = tree_steps = 0
    for i in range(3):
        env.reset(options={"prompt_index": i})
        steps = []
        for a in itertools.cycle(actions):
            before = list(env.session.tokens)
            _, _, term, trunc, info = env.step(a)
            assert not trunc, info
            steps.append(a)
            assert_caches_hold_committed_tokens(env)
            added = env.session.tokens[len(before):]
            if info["tree"] is not None:
                tree_steps += 1
                assert added == generate_target_only(env.pair, before, len(added)).new_ids
            rolled_back += info["rolled_back"]
            if term:
                break
        ref = BildSession(TreeRunner(env.pair, COSTS), env.prompts[i], 24, env.pair.eos_token_ids,
                           env.config.actions.max_draft_len)
        for a in steps:
            if a >= 25:
                session_tree_step(ref, parse_tree_rule(RULES[a - 25]))
            else:
                ref.step(*env.thresholds(a))
        assert ref.done and ref.tokens == env.session.tokens
        assert {f: getattr(ref.total, f) for f in COUNTS} == {f: getattr(env.session.total, f) for f in COUNTS}
    assert rolled_back > 0 and tree_steps >= 6  # rollbacks cropped caches that tree steps had gathered into, and back


@pytest.mark.parametrize("actions, match", [
    ({"space": "continuous"}, "tree_rules add discrete actions"),
    ({"tree_rules": ("16:6",)}, r"tree_rules: '16:6': give N:D:W"),
    ({"tree_rules": ("100:4:4",)}, r"tree_rules: .*at most 64"),
    ({"tree_rules": ("4,4,4,4",)}, r"tree_rules: .*340 nodes; at most 64"),
    ({"tree_rules": ("6:8:2:0.3", "3,x")}, r"tree_rules: '3,x'"),
    ({"tree_rules": ("3,2", "3,2")}, "the same rule as"),
    ({"tree_rules": "6:8:2:0.3"}, "tuple of rule texts"),
])
def test_bad_tree_rules_are_refused_naming_the_option(make_env, actions, match):
    cfg = EnvConfig(actions={"tree_rules": RULES} | actions)
    with pytest.raises(ValueError, match=match):
        validate(cfg)  # before any model loads
    with pytest.raises(ValueError, match=match):
        make_env(actions=actions)


def test_a_tree_step_needs_a_tree_runner(tiny_pair):
    session = BildSession(LiveRunner(tiny_pair), [5, 6, 7], 8, tiny_pair.eos_token_ids)
    with pytest.raises(TypeError, match="needs a runner that grows trees"):
        session_tree_step(session, parse_tree_rule("2,2"))


# -- the baselines: tree rules as fixed policies -------------------------------------------------------------------
def test_the_grid_search_runs_the_off_switch_and_each_tree_rule_as_fixed_actions(make_env):
    from agents.bild.baselines import FixedTree, GridSearch, grid_search
    from agents.bild.rollout import run_episode

    env = make_env(actions={"fallback_values": (0.103,), "rollback_values": (0.5,), "off_switch": True}, max_new_tokens=12)
    grid = grid_search(env, prompts=[0, 1], progress_bar=False)
    assert [p.label for p in grid.table] == ["0.103/0.5", "off", "tree 6:8:2:0.3", "tree 3,2,1,1"]
    assert [(p.fallback, p.rollback) for p in grid.table[1:]] == [(1.0, 0.0), (0.0, 0.0), (0.0, 0.0)]
    assert all(p.bleu == pytest.approx(100.0) for p in grid.table[1:])  # off and trees: lossless
    assert grid.label == grid.best.label and GridSearch(grid.table[2:]).label == max(
        grid.table[2:], key=lambda p: p.mean_return).label
    tree = FixedTree(env, "3,2,1,1")
    assert tree.action == env.unwrapped.tree_action("3,2,1,1") == 3
    again = [run_episode(env, tree, prompt_index=i).episode_return for i in (0, 1)]
    assert sum(again) / 2 == pytest.approx(grid.table[3].mean_return)
    with pytest.raises(ValueError, match="not one of the env's tree_rules"):
        FixedTree(env, "2,2")


def test_evaluate_adds_a_row_per_tree_rule_for_an_agent_trained_with_them(tmp_path, tiny_pair):
    """An agent of a tree env is checked against its spaces, acts live (tree actions are not in replay's trees), and
    each of its rules is a fixed row beside the threshold rows: lossless, so exact against the target's output."""
    import gymnasium

    from agents import RunConfig, make_dqn
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate
    from agents.config import DQNConfig

    run = tmp_path / "tree-run"
    run.mkdir()
    env_config = EnvConfig(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, actions={"tree_rules": ("2,2",)})
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, actions={"tree_rules": ("2,2",)})
    assert env.action_space.n == 26
    model = make_dqn(env, DQNConfig(learning_starts=10, buffer_size=100, target_update_interval=10), seed=0)
    model.learn(total_timesteps=20)
    model.save(run / "model.zip")
    RunConfig(env=env_config).save(run / "config.json")
    report = evaluate(Comparison(EvalConfig(model=str(run), num_prompts=2, grid_prompts=1, threshold_runs=2, adaptive="",
                                 bandits=False, out=str(tmp_path / "out"), progress_bar=False)))
    results = report["results"]
    assert {"tree 2,2", "BiLD + DQN", "BiLD fixed (0.103/4.697)"} <= set(results)
    assert results["tree 2,2"]["exact_match"] == 1.0 and results["tree 2,2"]["acceptance_rate"] is not None
    assert len(report["dqn_thresholds"]) == 2


def test_evaluate_takes_an_agent_trained_with_the_off_switch(tmp_path):
    """off_switch decides the action space (Discrete(26)): evaluate.py builds the agent's env with its run's value,
    so the agent is evaluated, not refused for its spaces."""
    import gymnasium

    from agents import RunConfig, make_dqn
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate
    from agents.config import DQNConfig

    run = tmp_path / "off-run"
    run.mkdir()
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, actions={"off_switch": True})
    assert env.action_space.n == 26
    model = make_dqn(env, DQNConfig(learning_starts=10, buffer_size=100, target_update_interval=10), seed=0)
    model.learn(total_timesteps=20)
    model.save(run / "model.zip")
    RunConfig(env=EnvConfig(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, actions={"off_switch": True})).save(run / "config.json")
    report = evaluate(Comparison(EvalConfig(model=str(run), num_prompts=2, grid_prompts=1, threshold_runs=2, adaptive="",
                                 bandits=False, out=str(tmp_path / "out"), progress_bar=False)))
    assert "BiLD + DQN" in report["results"]
