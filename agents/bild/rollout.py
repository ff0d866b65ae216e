"""One episode of a policy (an SB3 model or a baseline) in a BiLD-v1 (or BiLD-v0) env, on a chosen prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import time

import gymnasium as gym
import numpy as np


class Policy(Protocol):
    """Anything with SB3's ``predict``: SB3 models and the baselines of ``agents.bild.baselines``."""

    def predict(self, observation: np.ndarray, state: Any = None, episode_start: np.ndarray | None = None,
                deterministic: bool = True) -> tuple[np.ndarray, Any]: ...


@dataclass
class Episode:
    """What one episode gave: its return, length, the env's ``episode_summary`` (None after a model error),
    the actions taken and the wall time spent in the policy's ``predict`` (ms)."""

    prompt_index: int | None
    episode_return: float
    length: int
    summary: dict[str, Any] | None
    error: str | None = None
    actions: list = field(default_factory=list)  # grid indices, or arrays for a continuous action
    policy_ms: float = 0.0


def run_episode(env: gym.Env, policy: Policy, prompt_index: int | None = None, seed: int | None = None,
                deterministic: bool = True) -> Episode:
    """Reset (on ``prompt_index`` if given) and step ``policy`` until the episode ends."""
    options = None if prompt_index is None else {"prompt_index": int(prompt_index)}
    obs, info = env.reset(seed=seed, options=options)
    total, state, start, actions, policy_ms = 0.0, None, np.ones((1,), dtype=bool), [], 0.0
    while True:
        t0 = time.perf_counter()
        action, state = policy.predict(obs, state=state, episode_start=start, deterministic=deterministic)
        policy_ms += (time.perf_counter() - t0) * 1000.0
        arr = np.asarray(action)
        actions.append(int(arr.item()) if arr.size == 1 and np.issubdtype(arr.dtype, np.integer) else arr.copy())
        obs, reward, terminated, truncated, info = env.step(actions[-1])
        total, start = total + float(reward), np.zeros((1,), dtype=bool)
        if terminated or truncated:
            return Episode(prompt_index, total, len(actions), info.get("episode_summary"), info.get("error"),
                           actions, policy_ms)
