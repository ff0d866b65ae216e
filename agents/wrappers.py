"""Small wrappers: for evaluation envs, fixed prompts in a cycle and a record of episode summaries; for training
envs, a record of the episode in progress (its prompt and actions), from which a resumed run rebuilds it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np


class CyclePrompts(gym.Wrapper):
    """Resets go through ``prompt_indices`` in order, forever (an explicit ``prompt_index`` option still wins).

    With ``n_eval_episodes == len(prompt_indices)``, every evaluation sees each prompt exactly once,
    so evaluations at different training steps are comparable.
    """

    def __init__(self, env: gym.Env, prompt_indices: Sequence[int]) -> None:
        super().__init__(env)
        if not prompt_indices:
            raise ValueError("CyclePrompts needs at least one prompt index")
        self.prompt_indices = [int(i) for i in prompt_indices]
        self._next = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        options = dict(options or {})
        if "prompt_index" not in options:
            options["prompt_index"] = self.prompt_indices[self._next % len(self.prompt_indices)]
            self._next += 1
        return self.env.reset(seed=seed, options=options)

    @property
    def position(self) -> int:
        """How many prompts of the cycle resets have taken so far (saved with a checkpoint, set on resume)."""
        return self._next

    @position.setter
    def position(self, value: int) -> None:
        self._next = int(value)


class RecordSummaries(gym.Wrapper):
    """Keeps ``info["episode_summary"]`` of every finished episode in ``self.summaries`` (the reader clears it)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.summaries: list[dict] = []

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if "episode_summary" in info:
            self.summaries.append(info["episode_summary"])
        return obs, reward, terminated, truncated, info

    def pop_summaries(self) -> list[dict]:
        out, self.summaries = self.summaries, []
        return out


class RecordEpisode(gym.Wrapper):
    """Keeps the episode in progress: its prompt (``info["prompt_index"]`` of the reset) and the actions taken since.

    BiLD-v1's episode is a function of its prompt and its actions (the cost model's latency; the replay trees
    answer what live decoding would), so ``replay`` rebuilds it in a new process: ``agents.bild.resume`` saves
    ``episode()`` of every training env with a checkpoint and replays it on resume. Wrap the env itself, inside
    Monitor, so that the replayed steps pass through every other wrapper again.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.prompt_index: int | None = None
        self.actions: list[Any] = []

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        self.prompt_index, self.actions = int(info["prompt_index"]), []
        return obs, info

    def step(self, action):
        self.actions.append(np.array(action).tolist())  # an int, or the Box's two numbers
        return self.env.step(action)

    def episode(self) -> dict[str, Any]:
        """The episode in progress: ``{"prompt_index": i, "actions": [...]}`` (JSON-ready)."""
        return {"prompt_index": self.prompt_index, "actions": list(self.actions)}


def replay_episode(env: gym.Env, episode: dict[str, Any]) -> np.ndarray:
    """Reset ``env`` (a training env, with ``RecordEpisode`` inside) to ``episode``'s prompt and take its actions
    again; returns the observation it ends at. Every wrapper sees the steps (Monitor counts the rewards again)."""
    obs, _ = env.reset(options={"prompt_index": episode["prompt_index"]})
    space = env.action_space
    for action in episode["actions"]:
        obs, _, terminated, truncated, info = env.step(np.asarray(action, dtype=space.dtype) if space.shape else int(action))
        if terminated or truncated:
            raise RuntimeError(f"replaying the episode of prompt {episode['prompt_index']} ended it early "
                               f"({info.get('error', 'terminated')})")
    return obs


class PeekAll(gym.Wrapper):
    """Each step also reports what every other discrete action would have given from the state it leaves.

    ``info["peek"] = (observations, rewards, terminated)``, one row per action (the taken action's row is
    the step itself), from the env's ``peek`` (``BiLD-Serve-v0``: exact, from the replay trees), as
    ``agents.vec.BatchedReplayVecEnv(peek=True)`` reports it for ``BiLD-v1``; ``agents.dqn.AllActionsDQN``
    stores every row. Rows are given at truncation too (the taken row's observation is the last one, not
    the next episode's): a time limit is not an end, so every row bootstraps.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        if not isinstance(env.action_space, gym.spaces.Discrete) or not hasattr(env.unwrapped, "peek"):
            raise ValueError("PeekAll needs an env with a discrete action space and a peek() method")

    def step(self, action):
        taken = int(action)
        others = [a for a in range(int(self.action_space.n)) if a != taken]
        rows = self.env.unwrapped.peek(others)
        obs, reward, terminated, truncated, info = self.env.step(action)
        ended = np.zeros(len(others) + 1, dtype=bool)  # the serving env never terminates; a time limit is no end
        ended[taken] = terminated
        info["peek"] = (np.insert(rows[0], taken, obs, axis=0), np.insert(rows[1], taken, reward), ended)
        return obs, reward, terminated, truncated, info
