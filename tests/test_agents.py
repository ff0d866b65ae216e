"""Agents: the DQN factory, baseline policies (SB3's predict interface), grid search, eval wrappers."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

from agents import (
    ConfigError,
    DQNConfig,
    FixedThresholds,
    GridPoint,
    GridSearch,
    RandomPolicy,
    action_for,
    env_config,
    grid_search,
    make_dqn,
    run_episode,
)
from agents.wrappers import CyclePrompts, RecordSummaries
from bild_env.actions import Action
from bild_env.config import ActionOptions

from conftest import COSTS  # noqa: E402


ENV_DEFAULTS = {"max_new_tokens": 16}


# ------------------------------------------------------------------------------------------------
# DQN
def test_make_dqn_is_the_papers_network_with_replay_and_target(make_env):
    config = DQNConfig(learning_starts=7, target_update_interval=33)
    model = make_dqn(make_env(), config, seed=0)
    q_net = model.q_net.q_net
    linear = [m for m in q_net if hasattr(m, "out_features")]
    assert [m.out_features for m in linear] == [128, 128, 25] and linear[0].in_features == 7
    assert model.q_net_target is not model.q_net and model.replay_buffer.buffer_size == config.buffer_size
    assert (model.learning_starts, model.target_update_interval) == (7, 33)
    assert model.exploration_final_eps == config.exploration_final_eps


def test_dqn_config_refuses_bad_values():
    with pytest.raises(ConfigError, match=r"--hyperparams gamma must be a finite number in \[0, 1\], got 1.5"):
        DQNConfig(gamma=1.5)
    with pytest.raises(ConfigError, match="--hyperparams batch_size must be an integer >= 1"):
        DQNConfig(batch_size=0)
    assert DQNConfig(net_arch=[64]).sb3_kwargs()["policy_kwargs"] == {"net_arch": [64]}
    with pytest.raises(ConfigError, match="--hyperparams learning_rate_final must be a finite number in .*got 0.01"):
        DQNConfig(learning_rate=1e-3, learning_rate_final=1e-2)


def test_a_final_learning_rate_decays_the_step_size_over_the_run(make_env):
    model = make_dqn(make_env(), DQNConfig(learning_rate=1e-3, learning_rate_final=1e-5, learning_starts=0), seed=0)
    assert model.lr_schedule(1.0) == pytest.approx(1e-3) and model.lr_schedule(0.0) == pytest.approx(1e-5)
    model.learn(40)  # SB3 sets the optimizer's step size from the schedule at every update
    assert model.policy.optimizer.param_groups[0]["lr"] < 1e-3
    assert make_dqn(make_env(), DQNConfig(learning_rate=1e-3, learning_rate_final=None), seed=0).lr_schedule(0.0) == pytest.approx(1e-3)


@pytest.mark.parametrize("cls, values, message", [
    ("DQNConfig", {"learning_rate": float("inf")}, "--hyperparams learning_rate must be a finite number > 0, got inf"),
    ("DQNConfig", {"max_grad_norm": float("nan")}, "--hyperparams max_grad_norm must be a finite number > 0, got nan"),
    ("PPOConfig", {"n_steps": 0}, "--hyperparams n_steps must be an integer >= 1, got 0"),
    ("PPOConfig", {"learning_rate": float("nan")}, "--hyperparams learning_rate must be a finite number > 0, got nan"),
    ("PPOConfig", {"batch_size": 1}, "--hyperparams batch_size must be an integer >= 2, got 1"),
    ("PPOConfig", {"clip_range": 0.0}, "--hyperparams clip_range must be a finite number > 0"),
    ("PPOConfig", {"net_arch": (0,)}, "--hyperparams net_arch must be one or more hidden layer sizes >= 1, got 0"),
    ("A2CConfig", {"gamma": 5.0}, r"--hyperparams gamma must be a finite number in \[0, 1\], got 5.0"),
    ("A2CConfig", {"gae_lambda": -0.1}, r"--hyperparams gae_lambda must be a finite number in \[0, 1\]"),
    ("A2CConfig", {"ent_coef": float("inf")}, "--hyperparams ent_coef must be a finite number >= 0, got inf"),
    ("SACConfig", {"buffer_size": 0}, "--hyperparams buffer_size must be an integer >= 1, got 0"),
    ("SACConfig", {"ent_coef": "foo"}, "--hyperparams ent_coef must be a number > 0 .*got 'foo'"),
    ("SACConfig", {"ent_coef": "auto_-1"}, "--hyperparams ent_coef must be"),
    ("SACConfig", {"tau": 0.0}, r"--hyperparams tau must be a finite number in \(0, 1\]"),
    ("TrainConfig", {"policy_device": "foo"}, "--policy-device 'foo' is not a device"),
])
def test_every_hyperparameter_of_every_algorithm_is_checked_with_its_option_named(cls, values, message):
    import agents.config as config

    with pytest.raises(ConfigError, match=message):
        getattr(config, cls)(**values)


def test_sac_entropy_coefficient_forms():
    from agents.config import SACConfig

    assert SACConfig(ent_coef="0.1").sb3_kwargs()["ent_coef"] == 0.1  # a fixed coefficient, as a number for SB3
    assert SACConfig(ent_coef="auto_0.5").sb3_kwargs()["ent_coef"] == "auto_0.5"
    assert SACConfig().sb3_kwargs()["ent_coef"] == "auto"


# ------------------------------------------------------------------------------------------------
# baselines: the same predict as an SB3 model
def test_fixed_thresholds_maps_to_the_grid_action(make_env):
    env = make_env()
    config = env_config(env)
    policy = FixedThresholds(env)
    expected = config.actions.fallback_values.index(0.103) * len(config.actions.rollback_values) + config.actions.rollback_values.index(4.697)
    assert policy.action == expected and env.unwrapped.thresholds(policy.action) == (0.103, 4.697)
    other = make_env(actions={"fallback_values": (0.103, 0.5), "rollback_values": (2.0, 4.697, 9.0)})
    assert FixedThresholds(other).action == 1 and FixedThresholds(other, 0.5, 9.0).action == 5
    with pytest.raises(ValueError, match=r"fallback threshold 0.11 is not in the env's grid"):
        FixedThresholds(env, fallback=0.11)
    with pytest.raises(ValueError, match=r"rollback threshold 5.0 is not in the env's grid"):
        action_for(config, 0.103, 5.0)


def test_baselines_predict_like_an_sb3_model(make_env):
    env = make_env()
    obs, _ = env.reset(seed=0)
    batch = np.stack([obs, obs, obs])
    model = make_dqn(env, DQNConfig(), seed=0)
    point = GridPoint(3, 0.03, 4.697, 0.1, 50.0, 90.0, 0.8, 3.0, 16.0, episodes=2, errors=0)
    policies = [model, FixedThresholds(env), RandomPolicy(env, seed=0), GridSearch([point])]
    for policy in policies:
        one, state = policy.predict(obs, deterministic=True)
        many, _ = policy.predict(batch, state=None, episode_start=np.ones(3, dtype=bool), deterministic=True)
        assert state is None and np.asarray(one).shape == () and many.shape == (3,), policy
        assert env.action_space.contains(int(one)) and all(env.action_space.contains(int(a)) for a in many)
    with pytest.raises(ValueError, match=r"observation must have shape \(7,\) or \(n, 7\)"):
        FixedThresholds(env).predict(np.zeros(6))


def test_random_policy_is_seeded(make_env):
    env = make_env()
    obs = np.zeros(7, dtype=np.float32)
    draws = [[int(p.predict(obs)[0]) for _ in range(30)] for p in (RandomPolicy(env, 3), RandomPolicy(env, 3),
                                                                   RandomPolicy(env, 4))]
    assert draws[0] == draws[1] != draws[2] and len(set(draws[0])) > 5


def test_each_baseline_runs_a_full_episode(make_env):
    env = make_env(split="validation")
    grid = grid_search(env, prompts=[0], progress_bar=False)
    for policy in (FixedThresholds(env), RandomPolicy(env, seed=1), grid):
        episode = run_episode(env, policy, prompt_index=1)
        assert episode.error is None and episode.summary is not None and episode.length == episode.summary["steps"]
        assert 0 < episode.summary["new_tokens"] <= 16
        assert len(episode.actions) == episode.length and episode.policy_ms > 0
        if isinstance(policy, FixedThresholds):
            assert set(episode.actions) == {policy.action}
    fixed = run_episode(env, FixedThresholds(env), prompt_index=0).summary
    assert (fixed["mean_fallback"], fixed["mean_rollback"]) == pytest.approx((0.103, 4.697))


# ------------------------------------------------------------------------------------------------
# grid search
class ToyGridEnv(gymnasium.Env):
    """A hand-checkable stand-in: 2 x 2 thresholds, 2-step episodes, reward = GAIN[action] + prompt offset."""

    GAIN = (0.1, 0.7, 0.4, 0.7)  # actions 1 and 3 tie: the lower index wins
    OFFSET = (0.0, -1.0, 0.5)  # per prompt: the same for every action, so the ranking is the GAIN's

    def __init__(self, fail_action: int | None = None) -> None:
        self.action_space = spaces.Discrete(4)
        self.observation_space = spaces.Box(0.0, 1.0, (7,), np.float32)
        self.prompts = [None, None, None]
        self.config = type("Grid", (), {"actions": ActionOptions(fallback_values=(0.1, 0.3), rollback_values=(2.0, 5.0))})()
        self.fail_action = fail_action
        self.seen: dict[int, list[int]] = {}

    def thresholds(self, action: int) -> tuple[float, float]:
        return self.config.actions.fallback_values[action // 2], self.config.actions.rollback_values[action % 2]

    def decode(self, action: int) -> Action:  # what grid_search reads of each action (``BildEnv.decode``)
        return Action.bild(*self.thresholds(action))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.prompt, self.t = options["prompt_index"], 0
        return np.zeros(7, np.float32), {}

    def step(self, action):
        if self.t == 0:
            self.seen.setdefault(action, []).append(self.prompt)
        self.t += 1
        if action == self.fail_action:
            return np.zeros(7, np.float32), 0.0, False, True, {"error": "RuntimeError: out of memory"}
        done = self.t == 2
        info = {"episode_summary": {"latency_ms": 10.0 * (action + 1), "bleu": 50.0, "acceptance_rate": 0.5,
                                    "mean_accepted_length": 2.0, "new_tokens": 8}} if done else {}
        return np.zeros(7, np.float32), self.GAIN[action] + self.OFFSET[self.prompt], done, False, info


def test_grid_search_keeps_the_best_mean_return_on_the_same_prompts(tmp_path):
    env = ToyGridEnv()
    result = grid_search(env, prompts=2, progress_bar=False)
    # action a over prompts 0 and 1: return = 2 * GAIN[a] + 2 * mean(OFFSET[0], OFFSET[1]) = 2 * GAIN[a] - 1
    assert [p.mean_return for p in result.table] == pytest.approx([2 * g - 1 for g in ToyGridEnv.GAIN])
    assert result.action == 1 and (result.fallback, result.rollback) == (0.1, 5.0)
    assert env.seen == {a: [0, 1] for a in range(4)}
    assert [p.latency_ms for p in result.table] == [10.0, 20.0, 30.0, 40.0] and result.table[0].episodes == 2
    assert int(result.predict(np.zeros(7))[0]) == 1 and list(result.predict(np.zeros((2, 7)))[0]) == [1, 1]
    result.save(tmp_path / "grid.json")
    again = GridSearch.load(tmp_path / "grid.json")
    assert again.table == result.table and again.action == 1


def test_grid_search_never_picks_an_action_that_failed():
    result = grid_search(ToyGridEnv(fail_action=1), prompts=[2], progress_bar=False)
    assert result.table[1].errors == 1 and result.action == 3


def test_grid_search_on_the_env_matches_fixed_rollouts(make_env):
    env = make_env(split="validation", actions={"fallback_values": (0.103, 0.6), "rollback_values": (1.0, 4.697)})
    result = grid_search(env, prompts=2, progress_bar=False)
    assert len(result.rows()) == 4 and {"action", "latency_ms", "bleu", "acceptance_rate", "mean_return"} <= set(
        result.rows()[0])
    assert result.best.mean_return == max(p.mean_return for p in result.table)
    fixed = FixedThresholds(env, result.fallback, result.rollback)
    again = [run_episode(env, fixed, prompt_index=i) for i in (0, 1)]
    assert np.mean([e.episode_return for e in again]) == pytest.approx(result.best.mean_return)
    assert np.mean([e.summary["latency_ms"] for e in again]) == pytest.approx(result.best.latency_ms)


# ------------------------------------------------------------------------------------------------
# evaluation wrappers
def test_cycle_prompts_and_record_summaries(make_env):
    recorder = RecordSummaries(CyclePrompts(make_env(split="validation"), [2, 0]))
    seen = []
    for _ in range(3):
        _, info = recorder.reset()
        seen.append(info["prompt_index"])
        done = False
        while not done:
            _, _, term, trunc, _ = recorder.step(7)
            done = term or trunc
    assert seen == [2, 0, 2]
    assert recorder.reset(options={"prompt_index": 1})[1]["prompt_index"] == 1
    assert len(recorder.pop_summaries()) == 3 and recorder.summaries == []


def test_hyperparams_are_read_as_their_fields_types():
    from agents.config import PPOConfig, SACConfig
    from bild_env.cli import key_values

    def read(cls, items):
        return key_values(cls, items, "--hyperparams")

    assert read(SACConfig, ["ent_coef=auto_0.1", "net_arch=64,64", "tau=0.01", "batch-size=16"]) == {
        "ent_coef": "auto_0.1", "net_arch": (64, 64), "tau": 0.01, "batch_size": 16}
    assert read(PPOConfig, ["n_steps=32", "net_arch=32"]) == {"n_steps": 32, "net_arch": (32,)}
    assert PPOConfig(**read(PPOConfig, ["n_steps=32", "batch_size=32"])).sb3_kwargs()["n_steps"] == 32
    assert read(DQNConfig, ["learning_rate_final=none", "all_actions=no"]) == {"learning_rate_final": None,
                                                                               "all_actions": False}


def test_an_action_is_named_as_the_tables_show_it():
    from bild_env.actions import Action
    from bild_env.decoding.tree import parse_tree_rule

    assert Action.bild(0.103, 4.697).text == "(0.103, 4.697)"
    assert Action.off().text == "off"
    assert Action.tree(parse_tree_rule("6:8:2:0.3"), "6:8:2:0.3").text == "tree 6:8:2:0.3"
