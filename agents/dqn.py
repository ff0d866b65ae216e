"""The paper's agent: SB3's DQN (experience replay, target network) with a 128 -> 128 MLP Q-network."""

from __future__ import annotations

from stable_baselines3 import DQN
from stable_baselines3.common.type_aliases import GymEnv

from agents.config import DQNConfig


def make_dqn(env: GymEnv, config: DQNConfig | None = None, seed: int | None = None, device: str = "cpu",
             verbose: int = 0) -> DQN:
    """A fresh ``DQN("MlpPolicy", env, ...)`` with every hyperparameter from ``config`` (default ``DQNConfig()``).

    The Q-network maps the 7 observations to one Q-value per action (25 with the default grids).
    Logging is set by the caller (``model.set_logger``), so no ``tensorboard_log`` is given here.
    """
    config = config or DQNConfig()
    n_envs = getattr(env, "num_envs", 1)  # a VecEnv steps several envs at once
    return DQN("MlpPolicy", env, seed=seed, device=device, verbose=verbose, **config.sb3_kwargs(n_envs))
