"""Token-tree rules as actions of ``BiLD-Serve-v0`` (``tree_rules``): the spaces, lossless requests, exact read-ahead
(``peek``), what a tree step shows and charges, the refusals, and the validation rows the serving trainer draws."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from bild_env import generate_target_only
from bild_env.serving import clock

from test_serving import make_serve, toy_batch_costs, workload  # noqa: F401 (fixtures)

RULES = ("3,2,1", "8:4:2:0.2")


def test_check_env_passes_and_each_rule_is_one_more_action(make_serve):
    from gymnasium.utils.env_checker import check_env

    env = make_serve(actions={"tree_rules": RULES})
    u = env.unwrapped
    assert u.action_space == gymnasium.spaces.Discrete(25 + 1 + len(RULES))
    assert [u.tree_rule(a) for a in (24, 25, 26, 27)] == [None, None, "3,2,1", "8:4:2:0.2"]
    assert u.tree_action("8:4:2:0.20") == 27 and u.thresholds(25) is None
    check_env(u, skip_render_check=True)
    with pytest.raises(ValueError, match="26-27 = the tree rules"):
        env.reset(seed=0)
        env.step(28)


def test_tree_steps_serve_each_request_the_targets_greedy_output(make_serve, tiny_pair):
    """Every request served by tree steps alone (both rules in turn) ends with exactly target-only greedy decoding's
    tokens (float32); each step shows thresholds (0, 0), names its rule, commits at least a token per request and
    charges the batch's traces as the clock prices them."""
    env = make_serve(actions={"tree_rules": RULES}, load="constant:0.9")
    u = env.unwrapped
    env.reset(seed=1)
    finished, steps = [], 0
    for step in range(24):
        u.prepare()
        batch = len(u.active)
        a = 26 + step % 2
        obs, reward, _, trunc, info = env.step(a)
        assert info["tree"] == RULES[step % 2] and info["fallback"] == 0.0 and info["rollback"] == 0.0
        assert not info["off"] and info["committed"] >= batch
        assert obs[7] == 0.0 and obs[8] == 0.0 and obs[9] == 0.0
        finished += info["finished"]
        steps += 1
        if trunc:
            break
    assert len(finished) >= 4
    for f in finished:
        prompt = u.workload.prompts[f["domain"]][f["prompt_index"]]
        want = generate_target_only(tiny_pair, prompt, max_new_tokens=u.config.max_new_tokens).new_ids
        assert f["new_ids"] == list(want)
        assert f["regret_per_token"] == 0.0


def test_peek_of_tree_actions_equals_their_steps(make_serve):
    """``peek`` tries every action, tree steps included, from one state and leaves the episode as it was: each row
    equals the step of that action taken afterwards."""
    env = make_serve(actions={"tree_rules": RULES}, load="constant:0.7")
    u = env.unwrapped
    for a in (26, 27, 3, 25):
        env.reset(seed=5)
        for _ in range(3):
            env.step(26)
        obs, rewards, _ = u.peek()
        got, reward, *_ = env.step(a)
        assert np.array_equal(obs[a], got) and rewards[a] == pytest.approx(reward, abs=1e-12)


def test_a_tree_step_charges_each_level_and_one_verification(make_serve):
    """One request alone, a fixed tree 3,2,1: the draft is fed what its cache lacks, then the 3 nodes of level 1 and
    the 6 of level 2; the verification the root and all 15 nodes (3 + 6 + 6); the step's time is the clock's price."""
    env = make_serve(actions={"tree_rules": ("3,2,1",)}, load="constant:0.05", max_batch=1)
    u = env.unwrapped
    env.reset(seed=0)
    for _ in range(30):
        u.prepare()
        if u.active and len(u.active[0].session.new_ids) >= 2 and u.active[0].session.remaining > 3:
            break
        env.step(25)  # speculation off until a request is a few tokens in
    request = u.active[0]
    before = len(request.session.tokens)
    _, _, _, _, info = env.step(26)
    trace = list(request.runner.trace)
    assert trace == [("draft", before - trace[0][2], trace[0][2]), ("draft", 3, before), ("draft", 6, before + 3),
                     ("target", 16, before - 1)]
    step_ms, _ = clock.charge(u.cost_model, [trace])
    assert info["step_ms"] == pytest.approx(step_ms)


@pytest.mark.parametrize("kwargs, match", [
    ({"actions": {"per_domain": True, "tree_rules": RULES}}, "without per_domain"),
    ({"actions": {"space": "continuous", "tree_rules": RULES}}, "tree_rules add discrete actions"),
    ({"actions": {"tree_rules": ("16:6",)}}, r"tree_rules: '16:6': give N:D:W"),
    ({"actions": {"tree_rules": ("3,2", "3,2")}}, "the same rule as"),
    ({"actions": {"tree_rules": "3,2"}}, "tuple of rule texts"),
])
def test_bad_tree_options_are_refused_before_any_model_loads(kwargs, match):
    from bild_env.serving.config import ServingConfig, validate

    with pytest.raises(ValueError, match=match):
        validate(ServingConfig(**({"actions": {"tree_rules": RULES}} | kwargs)))


def test_validation_draws_a_row_per_tree_rule(make_serve):
    """The serving trainer's reference rows (``rule_references``) run each tree rule as a fixed row beside off and the
    tables, named by its rule; a tree env's grid maps onto another's by what each action does."""
    from agents.serve.rules import grid_map
    from agents.serve.validation import rule_references

    env = make_serve(actions={"tree_rules": RULES, "fallback_values": (0.3,), "rollback_values": (0.5,)}, episode_steps=6)
    out = rule_references([env.unwrapped], [0], ())
    assert {"tree 3,2,1", "tree 8:4:2:0.2", "off", "best_fixed", "batch_table", "load_table"} <= set(out)
    other = make_serve(actions={"tree_rules": ("8:4:2:0.2",), "fallback_values": (0.3,), "rollback_values": (0.5,)}, episode_steps=6)
    assert grid_map(env, other) == {0: 0, 1: 1, 3: 2}


def test_the_benchmark_runs_every_tree_rule_beside_the_actions_asked_for(make_serve):
    """``evaluate.py --env serve --actions tree_rules=R``: the rules' envs take the rules, each is among the fixed actions
    the tables choose from even where ``--fixed-actions`` names a subset, and it is labelled by its rule; an agent's own
    grid keeps its run's tree rules (none for a run without)."""
    from agents.serve.bench_config import QUICK, env_options
    from agents.serve.selection import action_set, label

    env = make_serve(actions={"tree_rules": RULES}).unwrapped
    assert action_set(env, (0, 5)) == [0, 5, 25, 26, 27]
    assert action_set(env, ()) == list(range(28))
    assert [label(env, a) for a in (25, 26, 27)] == ["off", "tree 3,2,1", "tree 8:4:2:0.2"]
    from dataclasses import replace

    from bild_env.config import over

    cfg = replace(QUICK, env=over(QUICK.env, {"actions": {"tree_rules": RULES}}))
    assert env_options(cfg, "validation", "constant:0.3")["actions"].tree_rules == RULES
    assert env_options(cfg, "test", "constant:0.3", actions={"tree_rules": ()})["actions"].tree_rules == ()


def test_the_evaluation_of_a_run_takes_the_world_it_was_trained_in_from_the_run(tmp_path):
    """``evaluate.py --env serve --model RUN`` (what the trainer prints) runs the rules and the agent in the run's
    world: its pair, dtype, cost profile, batch, draft cap and tree rules (before, the printed command had to name
    them, and once it left the tree rules out: the rules ran chains only beside an agent with trees); an option given
    on the command line still wins, and a model without a run config changes nothing."""
    import shlex

    from agents.serve.bench_config import QUICK
    from agents.serve.evaluation import parse
    from agents.serve.evaluation_agents import trained_world
    from agents.serve.options import ServeTrainConfig
    from agents.serve.run_report import next_commands
    from bild_env.serving.env import ServingConfig

    run = tmp_path / "run"
    run.mkdir()
    env = ServingConfig(pair="qwen2.5-coder", pair_options={"dtype": "bfloat16"},
                        cost_profile="xeon-amx-qwen2.5-coder-bf16", max_batch=8,
                        actions={"tree_rules": RULES, "max_draft_len": 1})
    (run / "config.json").write_text(ServeTrainConfig().spec(env).text())
    words = shlex.split(next_commands(run)[0].split("#")[0])
    assert words[:4] == ["python", "evaluate.py", "--env", "serve"] and words[4:] == ["--model", str(run)]
    e = parse(words[4:], trained_world(words[4:], QUICK)).env
    assert (e.pair, e.pair_options.dtype, e.cost_profile, e.max_batch, e.actions.max_draft_len, e.actions.tree_rules) == (
        "qwen2.5-coder", "bfloat16", "xeon-amx-qwen2.5-coder-bf16", 8, 1, RULES)
    bench = parse(words[4:], trained_world(words[4:], QUICK))
    assert (bench.levels, bench.episodes, bench.env.episode_steps) == (QUICK.levels, QUICK.episodes, 64)  # QUICK's
    given = words[4:] + ["--max-batch", "4", "--actions", f"tree_rules={RULES[0]}"]
    e = parse(given, trained_world(given, QUICK)).env
    assert (e.max_batch, e.actions.tree_rules, e.actions.max_draft_len, e.pair) == (4, RULES[:1], 1, "qwen2.5-coder")
    (tmp_path / "bare").mkdir()
    assert trained_world(["--model", str(tmp_path / "bare")], QUICK) is QUICK
    assert trained_world([], None) is None


