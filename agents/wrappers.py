"""Two small wrappers for evaluation envs: fixed prompts in a cycle, and a record of episode summaries."""

from __future__ import annotations

from collections.abc import Sequence

import gymnasium as gym


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
