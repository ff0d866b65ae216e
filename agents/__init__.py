"""Agents for BiLD-v0: the paper's DQN (Stable-Baselines3) and baseline policies with the same ``predict``."""

from agents.baselines import FixedThresholds, GridPoint, GridSearch, RandomPolicy, action_for, env_config, grid_search
from agents.config import DEFAULT_PAIR, ConfigError, DQNConfig, RunConfig, TrainConfig
from agents.dqn import make_dqn
from agents.rollout import Episode, run_episode

__all__ = [
    "DEFAULT_PAIR",
    "ConfigError",
    "DQNConfig",
    "Episode",
    "FixedThresholds",
    "GridPoint",
    "GridSearch",
    "RandomPolicy",
    "RunConfig",
    "TrainConfig",
    "action_for",
    "env_config",
    "grid_search",
    "make_dqn",
    "run_episode",
]
