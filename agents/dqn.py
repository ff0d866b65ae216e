"""The paper's agent: SB3's DQN (experience replay, target network) with a 128 -> 128 MLP Q-network.

``AllActionsDQN`` is that DQN, plus one thing: when its vec env reports in ``info["peek"]`` what every
action would have done at the state just left (``BatchedReplayVecEnv(peek=True)``, from the replay
trees), it stores those transitions, one per action, instead of only the one taken. Q-learning is
off-policy, so the extra transitions are valid experience; they make every action's estimate come
from the same states, so that comparing two actions no longer carries the spread between states
(prompts, positions): per-step rewards spread by 0.018-0.037 where good actions differ by 0.001-0.005
(README, "Why the agent does not beat the best fixed pair").
Without peeks it is SB3's DQN unchanged; its saved models load with ``DQN.load``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import GymEnv

from agents.config import DQNConfig


class AllActionsDQN(DQN):
    """SB3's ``DQN`` that learns from every action at every visited state when the env reports them (module docstring)."""

    def _store_transition(self, replay_buffer: ReplayBuffer, buffer_action: np.ndarray, new_obs: np.ndarray,
                          reward: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]]) -> None:
        peeks = [info.get("peek") for info in infos]
        if any(p is None for p in peeks) or self._vec_normalize_env is not None or isinstance(new_obs, dict):
            return super()._store_transition(replay_buffer, buffer_action, new_obs, reward, dones, infos)
        obs, n_envs = self._last_obs, len(infos)
        next_obs, rewards, terminated = (np.stack([p[k] for p in peeks], axis=1) for k in range(3))  # actions x envs
        no_timeouts = [{} for _ in range(n_envs)]
        for a in range(len(next_obs)):  # the taken action's transition is one of these
            replay_buffer.add(obs, next_obs[a], np.full((n_envs, 1), a), rewards[a], terminated[a], no_timeouts)
        self._last_original_obs = obs
        self._last_obs = new_obs


def make_dqn(env: GymEnv, config: DQNConfig | None = None, seed: int | None = None, device: str = "cpu",
             verbose: int = 0) -> DQN:
    """A fresh ``AllActionsDQN("MlpPolicy", env, ...)`` with every hyperparameter from ``config`` (default ``DQNConfig()``).

    The Q-network maps the observation to one Q-value per action (25 with the default grids).
    Logging is set by the caller (``model.set_logger``), so no ``tensorboard_log`` is given here.
    """
    config = config or DQNConfig()
    n_envs = getattr(env, "num_envs", 1)  # a VecEnv steps several envs at once
    n_actions = env.action_space.n if getattr(env, "peek", False) else 1  # transitions stored per env step
    return AllActionsDQN("MlpPolicy", env, seed=seed, device=device, verbose=verbose,
                         **config.sb3_kwargs(n_envs, n_actions))
