"""Learning from every action at every state: ``BildEnv.peek`` and ``--all-actions`` (AllActionsDQN)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from agents.bild import training as train
from agents.commands import train_main
from agents.bild.runs import checkpoints
from agents.common.trained import load_agent
from agents.config import RunConfig
from bild_env.env import BildEnv

ENV_DEFAULTS = {"backend": "replay", "observation": "rich", "max_new_tokens": 16}
TINY = ["--pair", "tiny-random", "--max-new-tokens", "8", "--n-envs", "2", "--torch-threads", "1", "--no-progress-bar",
        "--max-prompts", "4", "--eval-freq", "40", "--eval-episodes", "2", "--checkpoint-freq", "40",
        "--hyperparams", "learning_starts=20", "batch_size=16"]


def test_peek_gives_what_each_action_would_and_leaves_the_episode_as_it_was(make_env):
    peeking, plain = make_env().unwrapped, make_env().unwrapped
    rng = np.random.default_rng(0)
    lengths = []
    for prompt in range(4):
        a, _ = peeking.reset(options={"prompt_index": prompt})
        b, _ = plain.reset(options={"prompt_index": prompt})
        steps, terminated = 0, False
        while not terminated:
            observations, rewards, ends = peeking.peek()
            assert observations.shape == (25, 14) and rewards.shape == ends.shape == (25,)
            action = int(rng.integers(25))
            obs, reward, terminated, _, _ = peeking.step(action)
            obs_b, reward_b, terminated_b, _, _ = plain.step(action)
            # the peeked row is the step, and the peeks changed nothing the plain env would not do
            assert np.array_equal(observations[action], obs) and rewards[action] == reward and ends[action] == terminated
            assert np.array_equal(obs, obs_b) and reward == reward_b and terminated == terminated_b
            steps += 1
        assert peeking.summary() == plain.summary()
        lengths.append(steps)
    assert max(lengths) > 1


def test_peek_rows_differ_where_the_actions_do(make_env):
    env = make_env().unwrapped
    env.reset(options={"prompt_index": 0})
    _, rewards, _ = env.peek()
    _, fallback_only, _ = env.peek([5 * i for i in range(5)])  # every fallback, the smallest rollback
    assert np.array_equal(fallback_only, rewards[[0, 5, 10, 15, 20]])  # a subset gives the same rows
    assert len(set(rewards.round(12))) > 1  # the 25 actions do not all do the same


def test_peek_is_refused_clearly(make_env):
    live = make_env(backend="live").unwrapped
    live.reset(options={"prompt_index": 0})
    with pytest.raises(ValueError, match="backend='replay'"):
        live.peek()
    fresh = make_env().unwrapped
    with pytest.raises(RuntimeError, match="call reset"):
        fresh.peek()
    box = make_env(actions={"space": "continuous"}).unwrapped
    box.reset(options={"prompt_index": 0})
    with pytest.raises(ValueError, match="give the actions"):
        box.peek()
    assert box.peek([np.zeros(2, dtype=np.float32)])[1].shape == (1,)


def test_all_actions_dqn_stores_every_action_of_every_state_and_resumes(tmp_path):
    args = ["--hyperparams", "all_actions=true", "--log-dir", str(tmp_path), "--run-name", "run", *TINY]
    assert train_main([*args, "--total-timesteps", "80"]) == 0
    run = tmp_path / "run"
    assert RunConfig.load(run / "config.json").dqn.all_actions
    buffer = pickle.loads(checkpoints(run)[0].replay_buffer.read_bytes())  # the final one, at step 80
    rows = buffer.pos  # 2 envs per row; 25 rows (one per action) per vectorised step
    assert rows == 80 // 2 * 25 and not buffer.full
    actions = buffer.actions[:rows, :, 0]
    assert np.array_equal(actions[:, 0], np.tile(np.arange(25), rows // 25)) and np.array_equal(actions[:, 0], actions[:, 1])
    states = buffer.observations[:rows].reshape(rows // 25, 25, 2, -1)
    assert np.array_equal(states, np.broadcast_to(states[:, :1], states.shape))  # the 25 rows share their state
    assert train_main(["--resume", str(run), "--total-timesteps", "120", "--log-dir", str(tmp_path),
                       "--no-progress-bar", "--torch-threads", "1"]) == 0
    config = RunConfig.load(run / "config.json").env
    env = BildEnv(**{name: getattr(config, name) for name in config.__dataclass_fields__} | {"split": "validation"})
    model = load_agent(run / "model.zip", env)
    assert model.num_timesteps == 120
    env.close()


def test_bild_v1_trains_with_paired_actions_on_whole_states(tmp_path):
    """BiLD-v1's batched replay envs store a state's 25 actions side by side too: --paired-actions trains on them."""
    args = ["--hyperparams", "all_actions=true", "paired_actions=true", "--log-dir", str(tmp_path), "--run-name", "run", *TINY]
    assert train_main([*args, "--total-timesteps", "80"]) == 0
    config = RunConfig.load(tmp_path / "run" / "config.json")
    assert config.dqn.paired_actions
    env = BildEnv(**{name: getattr(config.env, name) for name in config.env.__dataclass_fields__} | {"split": "validation"})
    model = load_agent(tmp_path / "run" / "model.zip", env)
    assert model.paired_actions and model._n_updates > 0
    env.close()


def test_a_config_made_in_code_is_checked_too():
    from dataclasses import replace

    from agents.config import ConfigError

    config = RunConfig()
    config = replace(config, env=replace(config.env, backend="live", pair="tiny-random"))
    with pytest.raises(ConfigError, match="--hyperparams all_actions=false"):
        train.make_envs(config)


def test_runs_saved_before_the_option_keep_learning_from_the_action_taken():
    from agents.spec import RunSpec

    spec = RunConfig().spec()
    assert spec.hyperparams["all_actions"] is True and RunConfig.from_spec(spec).dqn.all_actions
    old = {"train": {"algo": "dqn"}, "dqn": {"learning_rate": 1e-3}, "env": {}}  # saved before the option (no version)
    assert RunConfig.from_spec(RunSpec.from_json(old)).dqn.all_actions is False


@pytest.mark.parametrize("argv, message", [
    (["--backend", "live"], "needs --backend replay; to train on the live backend give --hyperparams all_actions=false"),
    (["--hyperparams", "all_actions=true", "n_steps=3"], "give --hyperparams n_steps=1 (got 3) or all_actions=false"),
])
def test_all_actions_that_cannot_work_is_refused_with_what_to_change(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train_main([*argv, "--log-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_buffer_holds_the_same_env_steps_with_all_actions():
    from agents.config import DQNConfig

    assert DQNConfig(buffer_size=100, all_actions=False).sb3_kwargs(4, 25)["buffer_size"] == 100
    assert DQNConfig(buffer_size=100, all_actions=True).sb3_kwargs(4, 25)["buffer_size"] == 2500
    assert "all_actions" not in DQNConfig(all_actions=True).sb3_kwargs()


def test_a_failed_peek_leaves_that_step_to_plain_dqn_storage(monkeypatch):
    from stable_baselines3.common.env_util import make_vec_env

    from agents.vec import BatchedReplayVecEnv
    from conftest import COSTS  # noqa: E402

    kwargs = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 8, "backend": "replay",
              "render_mode": None}
    vec = make_vec_env("bild_env:BiLD-v0", n_envs=2, seed=0, env_kwargs=kwargs, vec_env_cls=BatchedReplayVecEnv,
                       vec_env_kwargs={"peek": True, "reward_scale": 2.0})
    vec.reset()
    failing = vec.envs[1].unwrapped

    def fail(actions=None):
        raise RuntimeError("BiLD-v0: peek() at action 0 failed: OutOfMemoryError")

    action_5 = vec.envs[0].unwrapped.peek([5])[1][0]  # before the step (peek leaves the episode as it was)
    monkeypatch.setattr(failing, "peek", fail)
    new_obs, rewards, _, infos = vec.step(np.array([3, 3]))
    assert "peek" not in infos[1]  # the failing env steps on without its peek
    observations, peek_rewards, _ = infos[0]["peek"]
    stepped = infos[0].get("terminal_observation", new_obs[0])  # (a finished episode has been reset already)
    assert observations.shape == (25, 7) and np.array_equal(observations[3], stepped)  # the taken row is the step
    # the other rows carry the training reward scale (the taken one has its wrappers' scale: none here)
    assert peek_rewards[3] == pytest.approx(rewards[0]) and peek_rewards[5] == pytest.approx(2.0 * action_5)
    vec.close()


def test_q_ensemble_takes_the_action_of_the_highest_mean_q_value():
    """Two DQNs with different (random) Q-networks: the ensemble's action is the argmax of their mean Q-values,
    for one observation and for a batch; with one member repeated it acts as that member; members that do not
    share spaces are refused."""
    import gymnasium
    import torch
    from stable_baselines3 import DQN

    from agents.dqn import QEnsemble

    env = gymnasium.make("CartPole-v1")
    a, b = (DQN("MlpPolicy", env, seed=s, learning_starts=0, policy_kwargs={"net_arch": [8]}) for s in (0, 1))
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    with torch.no_grad():
        qa, qb = (m.q_net(torch.as_tensor(obs)).numpy() for m in (a, b))
    ens = QEnsemble([a, b])
    assert ens.predict(obs)[0].tolist() == ((qa + qb) / 2).argmax(axis=1).tolist()
    assert int(ens.predict(obs[3])[0]) == int(((qa + qb) / 2)[3].argmax())
    assert (qa.argmax(1) != qb.argmax(1)).any()  # the members disagree somewhere: the mean decides
    assert QEnsemble([a, a]).predict(obs)[0].tolist() == a.predict(obs, deterministic=True)[0].tolist()
    other = DQN("MlpPolicy", gymnasium.make("Acrobot-v1"), learning_starts=0)
    with pytest.raises(ValueError, match="same observation and action spaces"):
        QEnsemble([a, other])
    with pytest.raises(ValueError, match="at least two"):
        QEnsemble([a])


class _NoisyBandit:
    """Two contexts; an action's reward is its context's mean plus noise drawn once per state, common to every action
    there (as the requests and drafts of a serving step are). Peeks give every action's reward at the state."""

    MEANS = np.array([[0.0, 0.10, 0.05, -0.05], [0.0, -0.05, 0.05, 0.10]])

    @classmethod
    def make(cls):
        import gymnasium as gym

        means = cls.MEANS

        class Bandit(gym.Env):
            observation_space = gym.spaces.Box(0, 1, (2,), np.float32)
            action_space = gym.spaces.Discrete(4)

            def reset(self, seed=None, options=None):
                super().reset(seed=seed)
                self._draw()
                return self._obs(), {}

            def _draw(self):
                self.c, self.z = int(self.np_random.integers(2)), float(self.np_random.normal(0.0, 1.0))

            def _obs(self):
                return np.eye(2, dtype=np.float32)[self.c]

            def peek(self, actions):
                return (np.stack([self._obs()] * len(actions)), np.array([means[self.c, a] + self.z for a in actions]),
                        np.zeros(len(actions), dtype=bool))

            def step(self, action):
                reward = means[self.c, int(action)] + self.z
                self._draw()
                return self._obs(), reward, False, False, {}

        return Bandit()


def _bandit_q_error(paired: bool, seed: int = 0) -> tuple[float, np.ndarray]:
    """A DQN (gamma 0) trained on the noisy bandit: the largest error of its Q-value differences to action 0 against the
    true ones, and its greedy action per context (docs/notes/bild-v1-agent.md, "Fitting a state's actions together",
    quotes seeds 0-2)."""
    import torch
    from stable_baselines3.common.env_util import make_vec_env

    from agents.dqn import AllActionsDQN
    from agents.wrappers import PeekAll

    env = make_vec_env(lambda: PeekAll(_NoisyBandit.make()), n_envs=2, seed=seed)
    model = AllActionsDQN("MlpPolicy", env, paired_actions=paired, gamma=0.0, learning_starts=100, batch_size=64,
                          buffer_size=4 * 2 * 1500, train_freq=1, target_update_interval=100, learning_rate=1e-3,
                          exploration_fraction=0.5, seed=seed, policy_kwargs={"net_arch": [32]}, device="cpu")
    model.learn(2400)
    with torch.no_grad():
        q = model.q_net(torch.eye(2)).numpy()
    true = _NoisyBandit.MEANS - _NoisyBandit.MEANS[:, :1]
    return float(np.abs(q - q[:, :1] - true).max()), q.argmax(axis=1)


def test_paired_actions_learn_the_differences_that_noise_common_to_a_state_hides():
    """Actions 0.05 apart under noise of 1.0 common to a state's actions: fitted state by state (paired) the
    Q-differences come out within 0.03 and the greedy action is right in both contexts; sampled one transition at a
    time (SB3's way) each action's estimate carries its own samples' noise, several times the differences."""
    error, greedy = _bandit_q_error(paired=True)
    assert error < 0.03 and list(greedy) == [1, 3]
    unpaired_error, _ = _bandit_q_error(paired=False)
    assert unpaired_error > 3 * error


def test_paired_actions_sample_whole_states_and_refuse_a_buffer_that_lost_them():
    from stable_baselines3.common.env_util import make_vec_env

    from agents.config import DQNConfig
    from agents.dqn import AllActionsDQN
    from agents.wrappers import PeekAll

    env = make_vec_env(lambda: PeekAll(_NoisyBandit.make()), n_envs=2, seed=1)
    model = AllActionsDQN("MlpPolicy", env, paired_actions=True, learning_starts=10, batch_size=8,
                          buffer_size=4 * 2 * 30, train_freq=1, seed=1, device="cpu")
    model.learn(100)  # past the buffer's 30 states: it wrapped and still holds whole states
    assert model.replay_buffer.full
    obs, next_obs, rewards, dones = model.sample_states(16)
    assert obs.shape == (16, 2) and next_obs.shape == (16, 4, 2) and rewards.shape == dones.shape == (16, 4)
    # a state's rows differ by the actions' means alone (the common noise cancels)
    diffs = (rewards - rewards[:, :1]).numpy()
    contexts = obs.numpy().argmax(axis=1)
    assert np.allclose(diffs, (_NoisyBandit.MEANS - _NoisyBandit.MEANS[:, :1])[contexts], atol=1e-5)
    model._unpaired_rows = True  # as after a step stored without peeks
    with pytest.raises(RuntimeError, match="PeekAll"):
        model.train(1, 8)
    with pytest.raises(ValueError, match="multiple of the 4 actions"):
        AllActionsDQN("MlpPolicy", env, paired_actions=True, buffer_size=4 * 2 * 30 + 2, device="cpu")
    with pytest.raises(ValueError, match="needs all_actions=true"):
        DQNConfig(all_actions=False, paired_actions=True)
    assert DQNConfig(paired_actions=True).sb3_kwargs(n_envs=3, n_actions=4)["buffer_size"] % (3 * 4) == 0
