"""What the serving agent sees: the load and how it moves, the batch's recent acceptance, the paper's numbers.

``ServingView`` is updated after every step; ``observe()`` gives the vector documented in
``ServingEnv``'s docstring (every entry scaled and clipped to its bounds, so a Q-network needs no
further normalisation). Moving averages weigh the newest step by ``FAST`` (acceptance, tokens per
step, time ratio, the fast load average) or ``SLOW`` (the slow load average, arrivals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gymnasium import spaces

FAST, SLOW = 0.3, 0.05
LONG_PROMPT = 512  # prompt lengths are observed as a share of this
N_BASE = 14
_LOW = np.array([0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
_HIGH = np.array([1, 2, 1, 2, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1], dtype=np.float32)


N_FORESEE = 3  # with observe next: the next proposals' mean score, spread, share at or above the fallback threshold


def _bounds(n_domains: int, foresee: bool = False) -> tuple[np.ndarray, np.ndarray]:
    extra = n_domains + (N_FORESEE if foresee else 0)
    return (np.concatenate([_LOW, np.zeros(extra, dtype=np.float32)]),
            np.concatenate([_HIGH, np.ones(extra, dtype=np.float32)]))


N_COSTS = 3  # with observe costs: what the hardware charges (``cost_features``)
COST_HIGH = (2.0, 4.0, 8.0)  # the bounds of the three hardware observations, never reached in practice


def observation_space(n_domains: int = 0, foresee: bool = False, costs: bool = False) -> spaces.Box:
    low, high = _bounds(n_domains, foresee)
    if costs:  # what the hardware charges: three more numbers after the rest (``cost_features``)
        low, high = np.concatenate([low, np.zeros(N_COSTS)]), np.concatenate([high, COST_HIGH])
    return spaces.Box(np.asarray(low, dtype=np.float32), np.asarray(high, dtype=np.float32), dtype=np.float32)


def cost_features(cost_model, max_batch: int, context: float) -> np.ndarray:
    """What the hardware charges, as an agent that must not depend on it observes it: the draft's forward over the
    target's (c), the target's rise fed 8 tokens (v(8) - 1) and its rise at ``max_batch`` sequences (log2 of the ratio),
    each fed 1 token at ``context`` cached tokens unless said; clipped to ``COST_HIGH``."""
    t1 = cost_model.batch_ms("target", 1, 1, context)
    values = (cost_model.batch_ms("draft", 1, 1, context) / t1, cost_model.batch_ms("target", 1, 8, context) / t1 - 1.0,
              math.log2(max(cost_model.batch_ms("target", max_batch, 1, context) / t1, 1.0)))
    return np.clip(np.array(values, dtype=np.float32), 0.0, np.array(COST_HIGH, dtype=np.float32))


def foresight(next_p: Sequence[float], fallback: float) -> list[float]:
    """The batch's next proposals seen ahead: their mean max probability, its spread (standard deviation, x2 so
    that it spans [0, 1]) and the share at or above ``fallback`` (the threshold last applied); (1, 0, 1) for an
    empty batch."""
    if not next_p:
        return [1.0, 0.0, 1.0]
    p = np.asarray(next_p, dtype=np.float64)
    return [float(p.mean()), float(2.0 * p.std()), float((p >= fallback).mean())]


def batch_feature(batch: float, max_batch: int, scale: str) -> float:
    """Observation 0: the batch size on ``scale`` ("linear": B / max_batch; "log": log2(1 + B) / log2(1 + max_batch),
    which sets batch 1 and 2 apart by 0.12 at max_batch 32 instead of 0.03)."""
    if scale == "log":
        return math.log2(1.0 + batch) / math.log2(1.0 + max_batch)
    return batch / max_batch


def batch_from_feature(value: float, max_batch: int, scale: str) -> int:
    """The batch size observation 0 holds (the inverse of ``batch_feature``, rounded)."""
    if scale == "log":
        return int(round(2.0 ** (float(value) * math.log2(1.0 + max_batch)) - 1.0))
    return int(round(float(value) * max_batch))


def _ema(old: float, new: float, weight: float) -> float:
    return old + weight * (new - old)


@dataclass
class ServingView:
    """The running quantities behind the serving observation (one episode)."""

    max_batch: int
    max_draft_len: int
    max_rollback: float
    max_new_tokens: int
    domains: Sequence[str] = ()
    batch_scale: str = "linear"  # how entry 0 reads the batch size: "linear" B / max_batch, "log" log2(1+B) / log2(1+max_batch)
    batch_fast: float = 0.0
    batch_slow: float = 0.0
    batch: float = 0.0
    queue: float = 0.0
    arrival_rate: float = 0.0
    capacity: float = 1.0
    acceptance: float = 0.5
    tokens_per_request: float = 1.0
    time_ratio: float = 1.0
    fallback: float = 0.103
    rollback: float = 4.697
    off: float = 0.0
    prompt_len: float = 0.0
    progress: float = 0.0
    regret_per_token: float = 0.0
    draft_p: float = 1.0
    shares: list[float] = field(default_factory=list)
    started: bool = False
    foresee: bool = False  # observe the next proposals (``foresight`` of ``next_p``)
    next_p: list[float] = field(default_factory=list)  # each running request's draft max probability for its next proposal

    def __post_init__(self) -> None:
        self.low, self.high = _bounds(len(self.domains), self.foresee)

    def arrivals(self, rate: float, capacity: float) -> None:
        """Fold the arrival rate seen over the last step (requests/s) into its moving average."""
        self.capacity = capacity
        self.arrival_rate = rate if not self.started else _ema(self.arrival_rate, rate, SLOW)
        self.started = True

    def begin(self, prompt_lens: list[int], progress: float, domains: list[str]) -> None:
        """The batch an episode starts with."""
        self.batch = self.batch_fast = self.batch_slow = float(len(prompt_lens))
        self.prompt_len = sum(prompt_lens) / len(prompt_lens) if prompt_lens else 0.0
        self.progress = progress
        self.shares = [sum(d == x for d in domains) / len(domains) if domains else 0.0 for x in self.domains]

    def after_step(self, *, decoding: int, queue: int, proposed: int, accepted: int, tokens: int, step_ms: float,
                   ref_ms: float, shown: tuple[float, float, float], prompt_lens: list[int], progress: float,
                   regret: float, generated: int, stops: list[float], domains: list[str]) -> None:
        """Fold a step into the view; ``shown``: the (fallback, rollback, off) it shows (``bild_env.actions.Plan.shown``:
        off steps show (1, 0, 1), tree steps (0, 0, 0); per_domain the batch's means)."""
        self.batch_fast = _ema(self.batch_fast, decoding, FAST)
        self.batch_slow = _ema(self.batch_slow, decoding, SLOW)
        self.batch, self.queue = float(len(prompt_lens)), float(queue)
        if proposed:
            self.acceptance = _ema(self.acceptance, accepted / proposed, FAST)
        if decoding:
            self.tokens_per_request = _ema(self.tokens_per_request, tokens / decoding, FAST)
        if ref_ms > 0:
            self.time_ratio = _ema(self.time_ratio, step_ms / ref_ms, FAST)
        self.fallback, self.rollback, self.off = shown
        self.prompt_len = sum(prompt_lens) / len(prompt_lens) if prompt_lens else 0.0
        self.progress = progress
        self.regret_per_token = regret / generated if generated else 0.0
        if stops:
            self.draft_p = sum(stops) / len(stops)
        self.shares = [sum(d == x for d in domains) / len(domains) if domains else 0.0 for x in self.domains]

    def observe(self) -> np.ndarray:
        m = self.max_batch
        values = [
            batch_feature(self.batch, m, self.batch_scale),
            self.queue / m,
            (self.batch_fast - self.batch_slow) / m,
            self.arrival_rate / self.capacity if self.capacity > 0 else 0.0,
            self.acceptance,
            self.tokens_per_request / (self.max_draft_len + 1),
            self.time_ratio,
            self.fallback,
            self.rollback / self.max_rollback,
            self.off,
            self.prompt_len / LONG_PROMPT,
            self.progress,
            self.regret_per_token / 2.0,
            self.draft_p,
        ]
        shares = self.shares or [0.0] * len(self.domains)
        ahead = foresight(self.next_p, self.fallback) if self.foresee else []
        return np.clip(np.asarray(values + list(shares) + ahead, dtype=np.float32), self.low, self.high)
