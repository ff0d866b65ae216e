"""``BatchedReplayVecEnv``: SB3's ``DummyVecEnv`` for BiLD-v1 (and BiLD-v0) envs on the replay backend.

Two changes to ``DummyVecEnv``, both set up at construction:

* its envs' replay runners share one ``TreeStore`` (the pair's process-wide store, or the one given,
  handed in at construction through ``bild_env.replay.sharing``): what one env fills, all read, and
* ``step``/``reset`` run the envs as cooperative jobs of a ``bild_env.replay.CoopBatcher``: when
  every unfinished env waits on a model forward (a miss), the waiting forwards run as one batched
  forward per model, and the envs resume in order.

With ``peek=True`` each env also reports what every action of its grid would have done from the
state it is leaving (``BildEnv.peek`` for the others, the step itself for the one taken), as ``info["peek"] = (observations, rewards,
terminated)`` with rewards times ``reward_scale`` (``AllActionsDQN`` stores them all; a step whose peek
failed, e.g. a model out of memory, reports none and is stored as SB3's DQN would).

Every env produces the same tokens, observations, rewards and infos as on its own (up to float
rounding in the batched forward; see ``bild_env.decoding.kv``), and a run is reproducible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv

from bild_env.replay import CoopBatcher, ReplayRunner, TreeStore, sharing


class BatchedReplayVecEnv(DummyVecEnv):
    """``DummyVecEnv`` for BiLD-v1 (and BiLD-v0) envs on the replay backend: shared trees, batched fills (module docstring).

    Use it like ``DummyVecEnv``, e.g. ``make_vec_env("bild_env:BiLD-v1", n_envs=8,
    vec_env_cls=BatchedReplayVecEnv, env_kwargs={"backend": "replay", ...})``. ``store``: the tree
    store the envs share (default: the pair's process-wide store, which every env of the pair made
    without a store of its own reads; pass another through make_vec_env's
    ``vec_env_kwargs={"store": ...}``).
    """

    def __init__(self, env_fns: list[Callable[[], Any]], store: TreeStore | None = None, peek: bool = False,
                 reward_scale: float = 1.0) -> None:
        with sharing(store) if store is not None else contextlib.nullcontext():
            super().__init__(env_fns)
        runners = [env.unwrapped.runner for env in self.envs]
        if not all(isinstance(r, ReplayRunner) for r in runners):
            raise ValueError("BatchedReplayVecEnv needs BiLD-v1 (or BiLD-v0) envs with backend='replay'; use DummyVecEnv for live envs")
        self.store = runners[0].store
        if any(r.store is not self.store for r in runners):
            raise ValueError("BatchedReplayVecEnv: its envs must share its tree store; do not give them a "
                             "replay_store of their own (pass it to the vec env as store=...)")
        self.batcher = CoopBatcher()
        self.peek, self.reward_scale = peek, reward_scale

    def step_wait(self):
        def step(i: int):
            def run():
                action, others = self.actions[i], None
                if self.peek:  # every action of the grid but the one taken: the step below gives that row
                    try:
                        others = self.envs[i].unwrapped.peek([a for a in range(self.action_space.n) if a != action])
                    except RuntimeError:  # a model failed filling a tree: the step below truncates the episode as usual
                        others = None
                obs, reward, terminated, truncated, info = self.envs[i].step(action)
                if others is not None and not truncated:  # (reward has the scale of the env's wrappers already)
                    info["peek"] = (np.insert(others[0], int(action), obs, axis=0),
                                    np.insert(others[1] * self.reward_scale, int(action), reward),
                                    np.insert(others[2], int(action), terminated))
                reset_info = None
                terminal = obs
                if terminated or truncated:
                    obs, reset_info = self.envs[i].reset()
                return obs, reward, terminated, truncated, info, terminal, reset_info
            return run

        results = self.batcher.run([step(i) for i in range(self.num_envs)])
        for i, (obs, reward, terminated, truncated, info, terminal, reset_info) in enumerate(results):
            self.buf_rews[i] = reward
            self.buf_dones[i] = terminated or truncated
            self.buf_infos[i] = info
            info["TimeLimit.truncated"] = truncated and not terminated  # as DummyVecEnv (gym 0.26 API change)
            if self.buf_dones[i]:
                info["terminal_observation"] = terminal
                self.reset_infos[i] = reset_info
            self._save_obs(i, obs)
        return self._obs_from_buf(), np.copy(self.buf_rews), np.copy(self.buf_dones), deepcopy(self.buf_infos)

    def reset(self):
        def reset(i: int):
            options = {"options": self._options[i]} if self._options[i] else {}
            return lambda: self.envs[i].reset(seed=self._seeds[i], **options)

        for i, (obs, info) in enumerate(self.batcher.run([reset(i) for i in range(self.num_envs)])):
            self.reset_infos[i] = info
            self._save_obs(i, obs)
        self._reset_seeds()
        self._reset_options()
        return self._obs_from_buf()
