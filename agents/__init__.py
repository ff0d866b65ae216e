"""Agents for BiLD-v0: the paper's DQN (Stable-Baselines3) and baseline policies with the same ``predict``.

``agents.training`` trains the DQN (``python train.py``); ``agents.runs`` reads and writes its run folders.
"""

from agents.baselines import FixedThresholds, GridPoint, GridSearch, RandomPolicy, action_for, env_config, grid_search
from agents.config import DEFAULT_PAIR, ConfigError, DQNConfig, RunConfig, TrainConfig
from agents.dqn import make_dqn
from agents.rollout import Episode, run_episode
from agents.runs import Checkpoint, latest_checkpoint, summarize

__all__ = [
    "DEFAULT_PAIR",
    "Checkpoint",
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
    "latest_checkpoint",
    "make_dqn",
    "run_episode",
    "summarize",
]
