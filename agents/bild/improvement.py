"""One step of policy iteration from a fixed threshold pair, fitted on rollouts (``BiLD-v1``, replay backend).

The replay env is deterministic, so the value of "threshold pair ``a`` at this step, then the ``base`` pair to
the end" is known exactly by running it: ``record_rollouts`` plays the ``base`` action on each prompt and, at
every step of that episode, rolls out each action of the grid once (``agents.bild.evaluation.Scripted``). Its return
minus the base episode's is the advantage ``A_base(s, a)`` of deviating once at that step.
``RolloutImprovement`` fits those advantages by ridge least squares on the observation (``features``) and acts
greedily on the fit: the action of highest predicted advantage where it is above ``margin``, else ``base``. With a
perfect fit this is the policy improvement step (never below ``base``); with a fit from what the observation
shows, it is the best a one-step learner with this observation can do against ``base``, which is how
``scripts/analysis/bild_predictability.py`` uses it. The same least squares serve ``scripts/analysis/serving_predictability.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from agents.bild.evaluation import Scripted
from agents.bild.rollout import run_episode


def features(observations: np.ndarray, drop: Sequence[int] = ()) -> np.ndarray:
    """[1, x, x_i * x_j for i <= j] of each row of ``observations`` (N, d) without the columns ``drop``:
    (N, 1 + d' + d' (d' + 1) / 2) for the d' columns kept."""
    x = np.atleast_2d(np.asarray(observations, dtype=np.float64))
    if len(drop):
        x = np.delete(x, list(drop), axis=1)
    i, j = np.triu_indices(x.shape[1])
    return np.hstack([np.ones((len(x), 1)), x, x[:, i] * x[:, j]])


def fit_ridge(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Weights (F, K) of ridge least squares of ``y`` (N, K) on ``x`` (N, F), the penalty ``ridge * N`` (not on
    the intercept, column 0)."""
    penalty = np.eye(x.shape[1]) * ridge * len(x)
    penalty[0, 0] = 0.0
    return np.linalg.solve(x.T @ x + penalty, x.T @ y)


def r_squared(y: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """1 - SSE / SST per column (nan where a column does not vary)."""
    sst = ((y - y.mean(0)) ** 2).sum(0)
    sse = ((y - predicted) ** 2).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sst > 0, 1.0 - sse / sst, np.nan)


class _Recorder:
    """Plays ``action`` and keeps every observation it was shown."""

    def __init__(self, action: int) -> None:
        self.action, self.observations = action, []

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        self.observations.append(np.asarray(observation, dtype=np.float64))
        return np.int64(self.action), state


def record_rollouts(env: gym.Env, base: int, prompts: Sequence[int], desc: str | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Along ``base``'s episode on each prompt: every step's observation (N, d), the return of each action of the
    grid played at that step with ``base`` before and after it (N, A; column ``base`` is the base episode's return),
    and the prompt of each row (N,)."""
    n_actions = env.action_space.n
    observations, returns, which = [], [], []
    for i in tqdm(prompts, desc=desc, leave=False, disable=desc is None):
        recorder = _Recorder(base)
        episode = run_episode(env, recorder, prompt_index=i)
        for t in range(len(episode.actions)):
            row = [episode.episode_return if a == base else
                   run_episode(env, Scripted([base] * t + [a], base), prompt_index=i).episode_return
                   for a in range(n_actions)]
            observations.append(recorder.observations[t])
            returns.append(row)
            which.append(i)
    return np.asarray(observations), np.asarray(returns, dtype=np.float64), np.asarray(which)


class RolloutImprovement:
    """The action whose fitted advantage over ``base`` (``features(obs, drop) @ weights``, weights (F, A)) is
    highest, where it is above ``margin``; else ``base``."""

    def __init__(self, weights: np.ndarray, base: int, margin: float = 0.0, drop: Sequence[int] = ()) -> None:
        self.weights, self.base, self.margin, self.drop = np.asarray(weights), int(base), float(margin), tuple(drop)

    @classmethod
    def fit(cls, observations: np.ndarray, returns: np.ndarray, base: int, ridge: float = 1e-3, margin: float = 0.0,
            drop: Sequence[int] = ()) -> RolloutImprovement:
        """Fitted on ``record_rollouts``' output: each action's advantage over ``base`` at each step."""
        advantage = returns - returns[:, [base]]
        return cls(fit_ridge(features(observations, drop), advantage, ridge), base, margin, drop)

    def advantages(self, observations: np.ndarray) -> np.ndarray:
        return features(observations, self.drop) @ self.weights

    def with_margin(self, margin: float) -> RolloutImprovement:
        return RolloutImprovement(self.weights, self.base, margin, self.drop)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        advantage = self.advantages(observation)[0]
        best = int(np.argmax(advantage))
        return np.int64(best if advantage[best] > self.margin else self.base), state
