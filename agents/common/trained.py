"""A trained agent read back for evaluation, for both envs (``evaluate.py``, ``bench.headroom``): ``choose_model``
picks the model of a run folder (or the shipped serving agent, ``--model pretrained``), ``zip_algo`` tells which
algorithm saved a model file and ``load_agent`` loads it, refused with the reason when it does not fit the env.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym

from agents.algos import ALGO_CLASSES
from agents.common.checks import read_model_zip
from agents.common.folders import best_model_info
from agents.config import ConfigError

# EnvConfig fields that decide what an agent sees and what its actions mean: an agent is evaluated with
# its run's values of these (the reward weights and quality term stay those of the evaluation).
AGENT_ENV_FIELDS = ("observation", "actions", "prompt_tokens")


PRETRAINED = "pretrained"  # --model pretrained: the serving agent shipped with the package (its card: README.md there)


def pretrained_run() -> Path:
    """The shipped BiLD-Serve-v0 agent: a run folder (``config.json``, ``best_model.zip``, its card ``README.md``) in
    ``bild_env/assets/serve-agent``, trained by ``python train.py --env serve`` with the defaults."""
    from bild_env.paths import ASSETS

    return ASSETS / "serve-agent"


def choose_model(path: str | Path) -> tuple[Path, str]:
    """A model file as given, or in a run folder the policy selected on validation (``best_model.zip``,
    kept by the evaluation callback) when there is one, else the final ``model.zip``; and why. ``"pretrained"``
    (where no such file or folder exists here) is the shipped serving agent (``pretrained_run``)."""
    if str(path) == PRETRAINED and not Path(path).exists():
        path = pretrained_run()
    path = Path(path)
    if not path.is_dir():
        return path, "the file given"
    best = path / "best_model.zip"
    if best.is_file():
        info = best_model_info(path)
        at = f", evaluated at step {info['step']}" if info and "step" in info else ""
        return best, f"the best mean validation return during training{at}"
    return path / "model.zip", "the final model: this run kept no best_model.zip"


def zip_algo(path: Path) -> str | None:
    """Which of DQN, SAC, PPO, A2C saved ``path``, from the attributes it saved (PPO and A2C load each other's
    files without complaint); None when it cannot be told."""
    try:
        data = read_model_zip(path)
    except ConfigError:  # not a readable SB3 zip: load_agent reports it
        return None
    for key, algo in (("exploration_fraction", "dqn"), ("target_entropy", "sac"), ("n_epochs", "ppo"),
                      ("gae_lambda", "a2c")):
        if key in data:
            return algo
    return None


def load_agent(path: str | Path, env: gym.Env):
    """An SB3 model (DQN, PPO, A2C or SAC) from a model file, refused with the reason when it is none of them
    or was trained for other observation or action spaces than ``env``'s (``ConfigError``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no model file at {path}")
    errors = []
    algo = zip_algo(path)
    for cls in [ALGO_CLASSES[algo]] if algo else ALGO_CLASSES.values():
        try:
            model = cls.load(path, device="cpu")
            break
        except Exception as err:  # noqa: BLE001 - SB3 raises several types for a zip of another algorithm
            errors.append(f"{cls.__name__}: {type(err).__name__}")
    else:
        raise ConfigError(f"{path} is not a DQN, PPO, A2C or SAC model.zip ({'; '.join(errors)})")
    if model.observation_space != env.observation_space or model.action_space != env.action_space:
        raise ConfigError(f"{path} was trained for observation space {model.observation_space} and action space "
                          f"{model.action_space}, but this env has {env.observation_space} and {env.action_space}: "
                          f"evaluate it with the env options it was trained with ({', '.join(AGENT_ENV_FIELDS)})")
    return model
