"""Training-free online baselines from BanditSpec (Hou et al., ICML 2025): UCBSpec and EXP3Spec.

Each picks, at every step, one arm (an action of the env's ``Discrete`` space: a threshold pair of BiLD-v1's grid, or
in BiLD-Serve-v0 a pair or speculation off) from the rewards the arms earned so far **in this episode**. Nothing is
trained and nothing is kept from one episode to the next: ``reset()`` at every episode start forgets everything, so
an episode's choices depend on that episode's rewards alone (online, per episode). Their few hyperparameters (the
exploration constant, the learning rate, the arm set) are chosen on validation episodes (``choose``), never on test.

The reward is the env's own per-step reward (BiLD-Serve-v0: time saved against target-only serving at the same load,
in single-request units, minus the regret charge; BiLD-v1: the same for one request), mapped to [0, 1] by one
documented bound (``rescale``): ``x = clip(1/2 + r / (2 * bound), 0, 1)``. ``REWARD_BOUND = 1``: a step saves at
most the target-only time of the tokens it commits, (max_draft_len + 1) per request, which is about 0.34 of one
request's time at batch 1 (32 new tokens) and about 1 at batch 32 on the smollm2 pair; a step that is slower by more,
or whose regret charge is larger (a lossy pair's), reads as the worst reward, 0.

A policy has ``reset(episode)``, ``act(observation) -> action`` and ``update(reward)`` (the reward of the last act),
and SB3's ``predict`` on top, so the evaluators run it as they run the rules; ``BanditFeedback`` is the wrapper that
hands it each step's reward and resets it with the env (the runners then need no change).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np

REWARD_BOUND = 1.0  # |per-step reward| mapped onto [0, 1] (module docstring); beyond it, clipped


def rescale(reward: float, bound: float = REWARD_BOUND) -> float:
    """The reward in [0, 1]: ``clip(1/2 + reward / (2 * bound), 0, 1)`` (``bound`` > 0, the reward's units)."""
    return float(min(1.0, max(0.0, 0.5 + reward / (2.0 * bound))))


def grid_arms(env: gym.Env) -> list[int]:
    """Every action of ``env``'s ``Discrete`` space (a ValueError for any other space: the bandits pick one arm)."""
    space = env.action_space
    if not isinstance(space, gym.spaces.Discrete):
        raise ValueError(f"the bandits pick one action of a Discrete space; this env's is {space} (a per-domain or "
                         "continuous action: make the env with the discrete grid)")
    return list(range(int(space.start), int(space.start) + int(space.n)))


def _check_common(arms: Sequence[int], bound: float) -> list[int]:
    arms = [int(a) for a in arms]
    if not arms:
        raise ValueError("a bandit needs at least one arm (an action to choose)")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct actions, got {arms}")
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
        raise ValueError(f"bound must be a finite number > 0 (the |reward| mapped onto [0, 1]), got {bound!r}")
    return arms


class _Bandit:
    """What both bandits share: the arm set, the act/update pairing and SB3's ``predict``."""

    name = "bandit"

    def __init__(self, arms: Sequence[int], bound: float) -> None:
        self.arms, self.bound = _check_common(arms, bound), float(bound)
        self._pending: int | None = None  # the arm index of the last act, until its reward comes

    def reset(self, episode: int | None = None) -> None:
        """Forget everything: a new episode starts (``episode``: its seed or prompt index, for a seeded bandit)."""
        self._pending = None

    def act(self, observation=None) -> int:
        """The env action to take now (the observation is not read: a bandit sees rewards only)."""
        if self._pending is not None:
            raise RuntimeError(f"{self.name}: act() again before update(reward) of the last action; run it through "
                               "BanditFeedback (or call update after each step)")
        self._pending = self._choose()
        return self.arms[self._pending]

    def update(self, reward: float) -> None:
        """The env's reward for the last ``act`` (in the env's units; rescaled here)."""
        if self._pending is None:
            raise RuntimeError(f"{self.name}: update() without an act() before it")
        i, self._pending = self._pending, None
        self._learn(i, rescale(float(reward), self.bound))

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        """SB3's ``predict`` for one observation (``deterministic`` is not read: EXP3Spec draws from its own seeded
        generator, UCBSpec is deterministic)."""
        return np.int64(self.act(observation)), state

    def _choose(self) -> int:
        raise NotImplementedError

    def _learn(self, i: int, x: float) -> None:
        raise NotImplementedError


class UCBSpec(_Bandit):
    """UCB1 over ``arms`` (BanditSpec's UCBSpec), per episode: first every arm once, in the order given; then the arm
    with the highest ``mean_i + c * sqrt(ln t / n_i)``, where ``mean_i`` is arm i's mean rescaled reward (in [0, 1])
    so far this episode, ``n_i`` its pulls and ``t`` all pulls (ties: the first in ``arms``). ``c`` >= 0: the
    exploration constant (UCB1's own is sqrt(2)); deterministic."""

    name = "UCBSpec"

    def __init__(self, arms: Sequence[int], c: float = math.sqrt(2.0), bound: float = REWARD_BOUND) -> None:
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise ValueError(f"UCBSpec: the exploration constant c must be a finite number >= 0, got {c!r}")
        super().__init__(arms, bound)
        self.c = float(c)
        self.reset()

    def reset(self, episode: int | None = None) -> None:
        super().reset(episode)
        self.counts = np.zeros(len(self.arms), dtype=np.int64)
        self.sums = np.zeros(len(self.arms))

    def index(self) -> np.ndarray:
        """Each arm's upper confidence bound now (``inf`` for an arm not pulled yet this episode)."""
        t = int(self.counts.sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            ucb = self.sums / self.counts + self.c * np.sqrt(math.log(max(t, 1)) / self.counts)
        return np.where(self.counts == 0, np.inf, ucb)

    def _choose(self) -> int:
        return int(np.argmax(self.index()))  # argmax keeps the first of equals

    def _learn(self, i: int, x: float) -> None:
        self.counts[i] += 1
        self.sums[i] += x

    def params(self) -> dict:
        return {"c": self.c, "arms": list(self.arms), "bound": self.bound}


class EXP3Spec(_Bandit):
    """EXP3 (Auer et al., 2002) over ``arms`` (BanditSpec's EXP3Spec), per episode: arm i is drawn with probability
    ``p_i = (1 - gamma) * w_i / sum(w) + gamma / K`` (K arms); after its rescaled reward x (in [0, 1]) only its weight
    moves, ``w_i *= exp(gamma * (x / p_i) / K)`` (the importance-weighted estimate x / p_i is unbiased for every
    arm). ``gamma`` in (0, 1]: the learning rate, also the share drawn uniformly. Draws come from a generator seeded
    by ``seed`` and the episode (``reset(episode)``), so an episode's draws do not depend on which ran before."""

    name = "EXP3Spec"

    def __init__(self, arms: Sequence[int], gamma: float = 0.1, bound: float = REWARD_BOUND, seed: int = 0) -> None:
        if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and 0 < gamma <= 1):
            raise ValueError(f"EXP3Spec: the learning rate gamma must be in (0, 1], got {gamma!r}")
        super().__init__(arms, bound)
        self.gamma, self.seed = float(gamma), int(seed)
        self._base = np.random.default_rng(self.seed)  # for episodes reset without a number
        self.reset()

    def reset(self, episode: int | None = None) -> None:
        super().reset(episode)
        self.log_weights = np.zeros(len(self.arms))
        self.rng = self._base if episode is None else np.random.default_rng([self.seed, int(episode)])

    @property
    def probabilities(self) -> np.ndarray:
        """``p``: each arm's chance of being drawn now (sums to 1)."""
        w = np.exp(self.log_weights - self.log_weights.max())
        return (1.0 - self.gamma) * w / w.sum() + self.gamma / len(self.arms)

    def _choose(self) -> int:
        return int(self.rng.choice(len(self.arms), p=self.probabilities))

    def _learn(self, i: int, x: float) -> None:
        p = self.probabilities[i]
        self.log_weights[i] += self.gamma * (x / p) / len(self.arms)

    def params(self) -> dict:
        return {"gamma": self.gamma, "arms": list(self.arms), "bound": self.bound, "seed": self.seed}


class BanditFeedback(gym.Wrapper):
    """Hands ``policy`` (a bandit) each step's reward (``update``) and resets it with the env (``reset(episode)``,
    the episode being the reset's seed, else its ``prompt_index`` option), so that any runner that only calls
    ``predict`` and ``env.step`` runs it. Wrap the env the policy acts in; close the inner env yourself."""

    def __init__(self, env: gym.Env, policy: _Bandit) -> None:
        super().__init__(env)
        grid = set(grid_arms(env))
        outside = [a for a in policy.arms if a not in grid]
        if outside:
            raise ValueError(f"{policy.name}: arms {outside} are not actions of this env ({env.action_space})")
        self.policy = policy

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        out = self.env.reset(seed=seed, options=options)
        episode = seed if seed is not None else (options or {}).get("prompt_index")
        self.policy.reset(episode)
        return out

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.policy.update(float(reward))
        return obs, reward, terminated, truncated, info


# -- hyperparameters, chosen on validation ---------------------------------------------------------
@dataclass(frozen=True)
class BanditGrid:
    """The hyperparameters tried on validation (each bandit: every value x every arm set); the best mean return
    there is kept. ``top``: arm sets of the k best fixed actions on validation (0: every action the rules choose
    among), as BanditSpec's candidate configurations are a short list a practitioner gives."""

    ucb_c: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3)  # UCBSpec's exploration constant (rewards in [0, 1])
    exp3_gamma: tuple[float, ...] = (0.05, 0.1, 0.3, 0.6)  # EXP3Spec's learning rate
    top: tuple[int, ...] = (3, 0)  # arm sets: the k best fixed actions on validation; 0 for all
    bound: float = REWARD_BOUND
    seed: int = 0  # EXP3Spec's generator


def make_bandit(kind: str, arms: Sequence[int], value: float, grid: BanditGrid = BanditGrid()) -> _Bandit:
    """``UCBSpec(arms, c=value)`` or ``EXP3Spec(arms, gamma=value)`` with the grid's bound and seed."""
    if kind == "UCBSpec":
        return UCBSpec(arms, c=value, bound=grid.bound)
    if kind == "EXP3Spec":
        return EXP3Spec(arms, gamma=value, bound=grid.bound, seed=grid.seed)
    raise ValueError(f"unknown bandit {kind!r}: UCBSpec or EXP3Spec")


def candidates(ranked: Sequence[int], grid: BanditGrid = BanditGrid()) -> list[tuple[str, int, float, list[int]]]:
    """Every (kind, top, value, arms) the grid tries; ``ranked``: the actions, best fixed action on validation first."""
    out, seen = [], []
    for top in grid.top:
        arms = list(ranked) if top == 0 or top >= len(ranked) else list(ranked[:top])
        if arms in seen:  # e.g. the top 3 of 3 actions: all of them, tried once
            continue
        seen.append(arms)
        for kind, values in (("UCBSpec", grid.ucb_c), ("EXP3Spec", grid.exp3_gamma)):
            out += [(kind, top, float(v), arms) for v in values]
    return out


def choose(score: Callable[[_Bandit], float], ranked: Sequence[int],
           grid: BanditGrid = BanditGrid()) -> dict[str, dict]:
    """Each bandit's best setting by ``score`` (the mean return of a fresh bandit on the validation episodes; ties:
    the first tried): ``{kind: {"value": ..., "top": ..., "arms": [...], "validation_return": ..., "tried": {...}}}``
    (``value``: UCBSpec's c or EXP3Spec's gamma)."""
    out: dict[str, dict] = {}
    for kind, top, value, arms in candidates(ranked, grid):
        s = float(score(make_bandit(kind, arms, value, grid)))
        entry = out.setdefault(kind, {"tried": {}, "grid": asdict(grid)})
        entry["tried"][f"{'c' if kind == 'UCBSpec' else 'gamma'}={value:g}, top={top or 'all'}"] = s
        if "validation_return" not in entry or s > entry["validation_return"]:
            entry.update(value=value, top=top, arms=list(arms), validation_return=s)
    return out


def chosen_bandit(kind: str, entry: dict) -> _Bandit:
    """A fresh bandit of ``choose``'s entry for ``kind``."""
    return make_bandit(kind, entry["arms"], entry["value"], BanditGrid(**entry["grid"]))


def describe(kind: str, entry: dict, label: Callable[[int], str] = str) -> str:
    """A row name: ``UCBSpec (c=0.1, arms: ...)``; ``label`` names an action."""
    what = "c" if kind == "UCBSpec" else "gamma"
    arms = "all" if entry["top"] == 0 else " ".join(label(a) for a in entry["arms"])
    return f"{kind} ({what}={entry['value']:g}, arms {arms}; chosen on validation)"
