"""Agents for BiLD-v1 and BiLD-Serve-v0: the paper's DQN, PPO, A2C and SAC (Stable-Baselines3), and baseline policies with the
same ``predict``.

A room per env over a shared floor, over the ground floor (``config``, ``algos``, ``dqn``, ``wrappers``, ``vec``, and
``spec``: a run's saved ``config.json``, one format for both envs, ``RunSpec``):

- ``agents.common``, the shared floor: what both envs share, written once: run folders and their lock, checkpoints written as one unit and the
  resume point past torn ones, logs that continue, callbacks and signals, evaluation statistics, model read-back;
- ``agents.bild``: BiLD-v1 (``python train.py``, ``--algo``; ``python evaluate.py``);
- ``agents.serve``: BiLD-Serve-v0 (``python train.py --env serve``; ``python evaluate.py --env serve``).

The two rooms never import each other; above them sit ``agents.commands`` (``evaluate.py``'s choice of env) and
``agents.tune`` and ``agents.rllib_serve`` (Ray).
"""

from agents.bild.baselines import FixedThresholds, GridPoint, GridSearch, RandomPolicy, action_for, env_config, grid_search
from agents.algos import make_model
from agents.config import DEFAULT_PAIR, A2CConfig, ConfigError, DQNConfig, PPOConfig, RunConfig, SACConfig, TrainConfig
from agents.dqn import make_dqn
from agents.bild.rollout import Episode, run_episode
from agents.bild.runs import latest_checkpoint, summarize
from agents.common.checkpoints import Checkpoint
from agents.spec import RunSpec

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
    "RunSpec",
    "TrainConfig",
    "action_for",
    "env_config",
    "grid_search",
    "latest_checkpoint",
    "make_dqn",
    "run_episode",
    "summarize",
]
