"""Agents for BiLD-v1 and BiLD-Serve-v0: the paper's DQN, PPO, A2C and SAC (Stable-Baselines3), and baseline policies with the
same ``predict``.

``agents.training`` trains one (``python train.py``, ``--algo``); ``agents.runs`` reads and writes its run folders.
"""

from agents.baselines import FixedThresholds, GridPoint, GridSearch, RandomPolicy, action_for, env_config, grid_search
from agents.algos import make_model
from agents.config import DEFAULT_PAIR, A2CConfig, ConfigError, DQNConfig, PPOConfig, RunConfig, SACConfig, TrainConfig
from agents.dqn import make_dqn
from agents.rollout import Episode, run_episode
from agents.runs import Checkpoint, latest_checkpoint, summarize

__all__ = [
    "DEFAULT_PAIR",
    "A2CConfig",
    "PPOConfig",
    "SACConfig",
    "make_model",
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
