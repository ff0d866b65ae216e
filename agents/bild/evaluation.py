"""Policies judged on many prompts: per-prompt returns and summaries, means with bootstrap intervals.

``returns_on_prompts`` runs one deterministic episode of a policy per prompt index (the same
prompts for every policy, so differences are paired); ``agents.common.stats.mean_ci`` is the 95% percentile-bootstrap
interval of a mean (scipy), used on a policy's returns or on the per-prompt differences of two;
``lookahead_returns`` is the per-step hindsight oracle (rollouts of ``Scripted`` policies); ``choose_bandits`` sets the
online bandits up on the select split's prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from tqdm.auto import tqdm

from agents.bild.rollout import Policy, run_episode
from agents.common import bandits

SUMMARY_FIELDS = ("latency_ms", "bleu", "regret", "fidelity", "acceptance_rate", "mean_accepted_length", "exact_match",
                  "target_only_ms")


@dataclass
class PromptResults:
    """One policy on a list of prompts: the return and the episode summary's numbers, per prompt."""

    prompts: list[int]
    returns: np.ndarray
    summaries: dict[str, np.ndarray]  # SUMMARY_FIELDS -> per-prompt values
    actions: list[list[int]]

    @classmethod
    def concat(cls, first: PromptResults, second: PromptResults) -> PromptResults:
        """The results of ``first``'s prompts followed by ``second``'s."""
        return cls(first.prompts + second.prompts, np.concatenate([first.returns, second.returns]),
                   {k: np.concatenate([first.summaries[k], second.summaries[k]]) for k in first.summaries},
                   first.actions + second.actions)

    def means(self) -> dict[str, float]:
        return {"return": float(self.returns.mean())} | {k: float(v.mean()) for k, v in self.summaries.items()}


def returns_on_prompts(env: gym.Env, policy: Policy, prompts: Sequence[int], desc: str | None = None,
                       progress_bar: bool = False) -> PromptResults:
    """One deterministic episode of ``policy`` on each prompt index; a model error is raised, not skipped."""
    returns, actions, rows = [], [], {k: [] for k in SUMMARY_FIELDS}
    for i in tqdm(prompts, desc=desc, disable=not progress_bar, leave=False):
        ep = run_episode(env, policy, prompt_index=i)
        if ep.summary is None:
            raise RuntimeError(f"prompt {i}: the episode ended with a model error: {ep.error}")
        returns.append(ep.episode_return)
        actions.append(ep.actions)
        for k in SUMMARY_FIELDS:
            rows[k].append(float(ep.summary[k]))
    return PromptResults(list(prompts), np.array(returns), {k: np.array(v) for k, v in rows.items()}, actions)


class Scripted:
    """A policy that plays ``prefix`` and then ``then`` forever (for rollouts)."""

    def __init__(self, prefix: list[int], then: int) -> None:
        self.prefix, self.then, self.t = prefix, then, 0

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        if episode_start is not None and np.asarray(episode_start).any():
            self.t = 0
        action = self.prefix[self.t] if self.t < len(self.prefix) else self.then
        self.t += 1
        return np.int64(action), state


def lookahead_returns(env: gym.Env, prompts: Sequence[int], base: int, actions: Sequence[int] | None = None) -> np.ndarray:
    """Per prompt, the return of the one-step lookahead policy with rollouts of the ``base`` action: at every
    step the action of ``actions`` (default: the whole grid) whose "this, then ``base`` to the end" return is
    highest, knowing it (ties: the lowest index). By the policy improvement theorem never below ``base``."""
    actions = list(range(env.action_space.n)) if actions is None else list(actions)
    out = []
    for i in tqdm(prompts, desc="per-step oracle", leave=False):
        prefix: list[int] = []
        while True:
            scored = []
            for a in actions:
                ep = returns_on_prompts(env, Scripted(prefix + [a], base), [i])
                scored.append((ep.returns[0], -a, len(ep.actions[0])))
            ret, neg_a, length = max(scored)
            prefix.append(-neg_a)
            if len(prefix) >= length:
                out.append(ret)
                break
    return np.array(out)


def choose_bandits(env: gym.Env, means: dict[int, float], progress_bar: bool = False) -> dict:
    """UCBSpec's and EXP3Spec's settings (``agents.common.bandits.choose``) by each candidate's mean return on
    ``env``'s prompts (the select split), the arms ranked by the fixed actions' mean returns there (``means``, best
    first; ties: the lower action), with each entry's ``arm_thresholds``."""
    prompts = list(range(len(env.prompts)))
    ranked = sorted(means, key=lambda a: (-means[a], a))
    bar = tqdm(total=len(bandits.candidates(ranked)), desc="bandits (select split)", disable=not progress_bar,
               leave=False)

    def score(bandit) -> float:
        bar.update(1)
        return float(returns_on_prompts(bandits.BanditFeedback(env, bandit), bandit, prompts).returns.mean())

    with bar:
        out = bandits.choose(score, ranked)
    for entry in out.values():
        entry["arm_thresholds"] = [env.thresholds(a) for a in entry["arms"]]
    return out
