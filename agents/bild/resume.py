"""What a checkpoint holds besides the model and its replay buffer, so that a resumed run goes on as the
uninterrupted one would: the same episodes, evaluations, checkpoints and TensorBoard steps.

A checkpoint is taken only where SB3's state is whole: at the start of a rollout, after the gradient steps of
the last one (``agents.common.callbacks.Checkpoints``), never in the middle of a step. There SB3's model file holds
its counters and last observations, and ``capture`` adds, in ``checkpoints/<algo>_state_<steps>_steps.json``:

* the random generators the run draws from: numpy's global one (DQN's exploration and replay sampling),
  torch's (PPO, A2C and SAC sample their actions with it), Python's, and the model's action space's
  (random actions before learning starts);
* each training env's episode in progress (``agents.wrappers.RecordEpisode``: its prompt and the actions
  taken) and each env's generator (the prompts it draws next);
* the evaluation env's place in its cycle of validation prompts, and the evaluations so far;
* what SB3's logger holds for its next write (the losses of the last gradient step are written with the
  next episode end).

``restore`` puts them back in a new process: it replays each env's episode (on the replay backend from the
trees, as the first time), then sets the generators, last of all, right before training goes on.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.vec_env import DummyVecEnv

from agents.wrappers import CyclePrompts, RecordEpisode, replay_episode

STATE_FORMAT = 1


def capture(model: BaseAlgorithm, train_env: DummyVecEnv, eval_cycle: CyclePrompts | None,
            evaluations: dict[str, list] | None) -> dict[str, Any]:
    """The state of a run at a checkpoint boundary, JSON-ready (module docstring)."""
    return {
        "format": STATE_FORMAT,
        "steps": int(model.num_timesteps),
        "rng": _rng_state(model),
        "envs": [_recorder(env).episode() | {"rng": env.unwrapped.np_random.bit_generator.state}
                 for env in train_env.envs],
        "eval_prompt_cycle": None if eval_cycle is None else eval_cycle.position,
        "evaluations": evaluations,
        "logger": _logger_state(model.logger),
    }


def restore(model: BaseAlgorithm, train_env: DummyVecEnv, eval_cycle: CyclePrompts | None,
            state: dict[str, Any]) -> list[int]:
    """Put ``state`` (from ``capture``) back: the envs' episodes, the evaluation cycle, the logger, then the generators.

    ``model`` was loaded with its last observations (``force_reset=False``) and its logger set. Returns the
    envs whose replayed episode did not end at the observation the model saved (their observation is taken;
    none, unless the env's code or the cost model changed since the checkpoint).
    """
    if len(state["envs"]) != train_env.num_envs:
        raise ValueError(f"the checkpoint has {len(state['envs'])} envs, this run {train_env.num_envs}")
    jobs = [lambda env=env, ep=ep: replay_episode(env, ep) for env, ep in zip(train_env.envs, state["envs"])]
    batcher = getattr(train_env, "batcher", None)  # BatchedReplayVecEnv: the envs' fills batched, as in a step
    observations = batcher.run(jobs) if batcher is not None else [job() for job in jobs]
    changed = []
    for i, (env, obs, saved) in enumerate(zip(train_env.envs, observations, state["envs"])):
        env.unwrapped.np_random.bit_generator.state = saved["rng"]
        train_env._save_obs(i, obs)  # DummyVecEnv's buffers, as after a step
        if not np.array_equal(np.asarray(obs, dtype=model._last_obs.dtype), model._last_obs[i]):
            changed.append(i)
            model._last_obs[i] = obs
    if eval_cycle is not None and state.get("eval_prompt_cycle") is not None:
        eval_cycle.position = int(state["eval_prompt_cycle"])
    _set_logger_state(model.logger, state.get("logger") or {})
    _set_rng_state(model, state["rng"])  # last: nothing above may draw from them
    return changed


def read_state(path: Path, steps: int | None = None) -> dict:
    """A checkpoint's resume state (``agents.bild.resume``)."""
    state = json.loads(Path(path).read_text())
    if not isinstance(state, dict) or "rng" not in state or "envs" not in state:
        raise ValueError("not a resume state")
    if steps is not None and state.get("steps", steps) != steps:
        raise ValueError(f"holds step {state.get('steps')}, not step {steps}'s")
    return state



# ------------------------------------------------------------------------------------------------
def _recorder(env: gym.Env) -> RecordEpisode:
    while not isinstance(env, RecordEpisode):
        if not isinstance(env, gym.Wrapper):
            raise TypeError("a training env without agents.wrappers.RecordEpisode: its episode cannot be saved")
        env = env.env
    return env


def _rng_state(model: BaseAlgorithm) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, words, gauss = random.getstate()
    state = {"numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "python": [version, list(words), gauss],
             "torch": torch.get_rng_state().tolist(),
             "action_space": model.action_space.np_random.bit_generator.state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(model: BaseAlgorithm, state: dict[str, Any]) -> None:
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])
    model.action_space.np_random.bit_generator.state = state["action_space"]


def _logger_state(logger: Logger) -> dict[str, Any]:
    values = {k: _plain(v) for k, v in logger.name_to_value.items()}
    values = {k: v for k, v in values.items() if v is not None}
    return {"values": values, "counts": {k: int(logger.name_to_count[k]) for k in values if k in logger.name_to_count},
            "excluded": {k: list(logger.name_to_excluded.get(k, ("",))) for k in values}}


def _set_logger_state(logger: Logger, state: dict[str, Any]) -> None:
    logger.name_to_value.update(state.get("values", {}))
    logger.name_to_count.update(state.get("counts", {}))
    logger.name_to_excluded.update({k: tuple(v) for k, v in state.get("excluded", {}).items()})


def _plain(value: Any) -> float | int | str | None:
    """A logged value as JSON holds it (None: one that cannot be, e.g. a figure: not carried over)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        return value.item()
    print(f"train.py: a logged value of type {type(value).__name__} is not kept across the checkpoint",
          file=sys.stderr)
    return None
