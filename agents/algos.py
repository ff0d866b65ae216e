"""The Stable-Baselines3 algorithms ``train.py --algo`` trains: DQN (the paper's), PPO, A2C and SAC."""

from __future__ import annotations

from stable_baselines3 import A2C, PPO, SAC
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.type_aliases import GymEnv

from agents.config import RunConfig, check_algo
from agents.dqn import AllActionsDQN

ALGO_CLASSES: dict[str, type[BaseAlgorithm]] = {"dqn": AllActionsDQN,  # SB3's DQN (+ DQNConfig.all_actions)
                                                  "ppo": PPO, "a2c": A2C, "sac": SAC}


def algo_class(name: str) -> type[BaseAlgorithm]:
    return ALGO_CLASSES[name]


def off_policy(name: str) -> bool:
    """Whether the algorithm keeps a replay buffer (saved with each checkpoint)."""
    return name in ("dqn", "sac")


def make_model(config: RunConfig, env: GymEnv, seed: int | None = None, device: str = "cpu",
               verbose: int = 0) -> BaseAlgorithm:
    """A fresh model of ``config.train.algo`` with every hyperparameter from its config section."""
    algo = config.train.algo
    check_algo(algo, config.env.actions.space)
    n_envs = getattr(env, "num_envs", 1)
    peeks = getattr(env, "peek", False)  # the vec env reports every action's step (DQNConfig.all_actions)
    kwargs = (config.dqn.sb3_kwargs(n_envs, env.action_space.n if peeks else 1) if algo == "dqn"
              else config.algo_config.sb3_kwargs(n_envs))
    return algo_class(algo)("MlpPolicy", env, seed=seed, device=device, verbose=verbose, **kwargs)
