"""Baseline policies with an SB3 model's ``predict``: fixed thresholds, a fixed tree rule, random, and grid search.

All of them take one observation (shape ``(7,)``) or a batch (``(n, 7)``, as from a VecEnv) and
return ``(actions, None)`` with actions of shape ``()`` or ``(n,)``, like ``model.predict``; so an
evaluator treats them and a trained DQN the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm.auto import tqdm

from agents.bild.rollout import run_episode
from bild_env.actions import tree_action_of
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK
from bild_env.env import EnvConfig


def env_config(env: Any) -> EnvConfig:
    """The ``EnvConfig`` of a BiLD-v1 (or BiLD-v0) env, wrapped or not, or of the first env of an SB3 VecEnv."""
    if hasattr(env, "get_attr"):  # an SB3 VecEnv
        return env.get_attr("config", indices=[0])[0]
    return env.unwrapped.config


def action_for(config: EnvConfig, fallback: float, rollback: float) -> int:
    """The action whose thresholds are (fallback, rollback) in the config's grids; ValueError if none is."""
    def index(values: Sequence[float], x: float, name: str) -> int:
        for i, v in enumerate(values):
            if math.isclose(v, x, rel_tol=1e-9, abs_tol=1e-12):
                return i
        raise ValueError(f"{name} threshold {x} is not in the env's grid {tuple(values)}; "
                         f"pick one of those or give the env a grid that holds it ({name}_values=...)")

    acts = config.actions
    return (index(acts.fallback_values, fallback, "fallback") * len(acts.rollback_values)
            + index(acts.rollback_values, rollback, "rollback"))


def _batch_size(observation: Any, shape: tuple[int, ...]) -> int | None:
    """None for one observation of ``shape``, n for a batch of shape ``(n, *shape)``."""
    obs = np.asarray(observation)
    if obs.shape == shape:
        return None
    if obs.shape[1:] == shape and obs.ndim == len(shape) + 1:
        return obs.shape[0]
    raise ValueError(f"observation must have shape {shape} or (n, {', '.join(map(str, shape))}), got {obs.shape}")


def _constant(observation: Any, shape: tuple[int, ...], action: int) -> np.ndarray:
    """``action`` for one observation (shape ``()``) or for each of a batch (shape ``(n,)``)."""
    n = _batch_size(observation, shape)
    return np.full(() if n is None else (n,), action, dtype=np.int64)


class FixedAction:
    """Always ``action`` (the grid search's policy for each action of the grid, the off switch and the tree rules); the
    base of the fixed policies below."""

    def __init__(self, action: int, observation_shape: tuple[int, ...]) -> None:
        self.action, self.observation_shape = action, observation_shape

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return _constant(observation, self.observation_shape, self.action), state


class FixedThresholds(FixedAction):
    """Always the same action: BiLD with fixed thresholds (default the paper's 0.103 / 4.697)."""

    def __init__(self, env: Any, fallback: float = FIXED_FALLBACK, rollback: float = FIXED_ROLLBACK) -> None:
        self.fallback, self.rollback = fallback, rollback
        super().__init__(action_for(env_config(env), fallback, rollback), env.observation_space.shape)

    def __repr__(self) -> str:
        return f"FixedThresholds(fallback={self.fallback}, rollback={self.rollback}, action={self.action})"


class FixedTree(FixedAction):
    """Always the same tree action: lossless token-tree speculation with one rule (``EnvConfig.tree_rules``)."""

    def __init__(self, env: Any, rule: str) -> None:
        self.rule = rule
        super().__init__(tree_action_of(env_config(env), rule), env.observation_space.shape)

    def __repr__(self) -> str:
        return f"FixedTree(rule={self.rule!r}, action={self.action})"


class RandomPolicy:
    """A uniformly random action at every step, from its own seeded generator (``deterministic`` is ignored)."""

    def __init__(self, env: Any, seed: int | None = None) -> None:
        self.n_actions = int(env.action_space.n)
        self.observation_shape = env.observation_space.shape
        self.rng = np.random.default_rng(seed)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        n = _batch_size(observation, self.observation_shape)
        return self.rng.integers(self.n_actions, size=() if n is None else (n,), dtype=np.int64), state


@dataclass(frozen=True)
class GridPoint:
    """The mean result of one fixed action over the grid search's prompts (latency in ms per sentence)."""

    action: int
    fallback: float
    rollback: float
    mean_return: float
    latency_ms: float
    bleu: float
    acceptance_rate: float
    mean_accepted_length: float
    new_tokens: float
    episodes: int
    errors: int  # episodes a model failure cut short (left out of the means; such an action is never best)
    name: str | None = None  # None: a threshold pair; "off" (speculation off) or "tree <rule>" (a tree action)

    @property
    def label(self) -> str:
        """How a row names it: ``0.103/4.697``, ``off`` or ``tree 6:8:2:0.3``."""
        return self.name or f"{self.fallback}/{self.rollback}"


class GridSearch(FixedAction):
    """The fixed action with the best mean return over a grid search (see ``grid_search``).

    ``table`` holds every action's ``GridPoint`` (the speed/quality plane), ``best`` the chosen one:
    the highest mean return among actions without model errors, the lowest action index on ties.
    """

    def __init__(self, table: Sequence[GridPoint], observation_shape: tuple[int, ...] = (7,)) -> None:
        self.table = sorted(table, key=lambda p: p.action)
        ok = [p for p in self.table if p.errors == 0]
        if not ok:
            raise RuntimeError("grid search: every action hit a model error; nothing to choose from")
        self.best = max(ok, key=lambda p: p.mean_return)  # max keeps the first of equals
        self.fallback, self.rollback = self.best.fallback, self.best.rollback
        self.label = self.best.label  # ``0.103/4.697``, ``off`` or ``tree <rule>``
        super().__init__(self.best.action, tuple(observation_shape))

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.table]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"observation_shape": list(self.observation_shape), "table": self.rows()},
                                         indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GridSearch:
        data = json.loads(Path(path).read_text())
        return cls([GridPoint(**row) for row in data["table"]], tuple(data["observation_shape"]))

    def __repr__(self) -> str:
        return (f"GridSearch(best action {self.action}: fallback={self.fallback}, rollback={self.rollback}, "
                f"mean return {self.best.mean_return:.4f} over {self.best.episodes} episodes)")


def grid_search(env: gym.Env, prompts: int | Sequence[int] | None = None, progress_bar: bool = True) -> GridSearch:
    """Run every fixed action for one episode on each prompt and keep the best by mean episode return.

    ``env`` should use the validation split (``split="validation"``). ``prompts``: prompt indices,
    or N for the first N prompts, or None for all of the env's prompts. Every action sees the same
    prompts (``reset(options={"prompt_index": i})``). Costs ``n_actions * len(prompts)`` episodes.
    The off switch and the tree rules (``off_switch``, ``tree_rules``) are fixed actions too: their rows are named
    ``off`` and ``tree <rule>`` (``GridPoint.name``), with the thresholds their steps show.
    """
    base = env.unwrapped
    if prompts is None:
        prompts = len(base.prompts)
    indices = list(range(min(prompts, len(base.prompts)))) if isinstance(prompts, int) else [int(i) for i in prompts]
    if not indices:
        raise ValueError("grid search needs at least one prompt")
    n_actions = int(env.action_space.n)
    table = []
    with tqdm(total=n_actions * len(indices), desc="grid search", unit="episode", disable=not progress_bar) as bar:
        for action in range(n_actions):
            chosen = base.decode(action)  # ``bild_env.actions.Action``: the thresholds its steps show, its name
            policy = FixedAction(action, env.observation_space.shape)
            episodes = []
            for i in indices:
                episodes.append(run_episode(env, policy, prompt_index=i))
                bar.update(1)
            table.append(_grid_point(action, chosen.fallback, chosen.rollback, episodes, chosen.name))
    return GridSearch(table, env.observation_space.shape)


def _grid_point(action: int, fallback: float, rollback: float, episodes: list, name: str | None = None) -> GridPoint:
    done = [e for e in episodes if e.summary is not None]

    def mean(key: str) -> float:
        return float(np.mean([e.summary[key] for e in done])) if done else math.nan

    return GridPoint(
        action=action, fallback=fallback, rollback=rollback,
        mean_return=float(np.mean([e.episode_return for e in done])) if done else math.nan,
        latency_ms=mean("latency_ms"), bleu=mean("bleu"), acceptance_rate=mean("acceptance_rate"),
        mean_accepted_length=mean("mean_accepted_length"), new_tokens=mean("new_tokens"),
        episodes=len(done), errors=len(episodes) - len(done), name=name,
    )
