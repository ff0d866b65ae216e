"""What the agent sees: the paper's 7 numbers, or those plus what the last step did ("rich").

The env keeps an ``EpisodeView`` up to date after every step; ``observe(kind, view)`` turns it into
the observation vector and ``observation_space(kind)`` gives its ``Box``. Every entry is scaled to
[0, 1] (the latency ratio to [0, 2]) and clipped, so a Q-network needs no further normalisation.

| index | paper | meaning | min | max |
|---|---|---|---|---|
| 0 | yes | mean accepted length so far: tokens per target forward / (max_draft_len + 1) | 0 | 1 |
| 1 | yes | BLEU so far / 100 (output vs the target's greedy output cut to the same length) | 0 | 1 |
| 2 | yes | latency per generated token so far / target-only latency for the same tokens (1 before the first step) | 0 | 2 |
| 3 | yes | previous fallback threshold (BiLD's 0.103 at reset) | 0 | 1 |
| 4 | yes | previous rollback threshold / max(rollback_values) (4.697 at reset) | 0 | 1 |
| 5 | yes | prompt length / prompt_tokens | 0 | 1 |
| 6 | yes | fraction of max_new_tokens generated | 0 | 1 |
| 7 | rich | last step: draft tokens proposed / max_draft_len | 0 | 1 |
| 8 | rich | last step: share of them the target kept (0 when none was proposed) | 0 | 1 |
| 9 | rich | last step: the draft fell back (1) or stopped at max_draft_len / the end (0) | 0 | 1 |
| 10 | rich | last step: the target rolled a draft token back | 0 | 1 |
| 11 | rich | the draft's max probability when its last run stopped (1 at reset) | 0 | 1 |
| 12 | rich | recent acceptance: moving average (weight 1/2 per step) of the steps' kept shares (1/2 at reset) | 0 | 1 |
| 13 | rich | regret so far, nats per generated token / 2 (kept draft tokens' log-probability gap to the target's choice) | 0 | 1 |
| 14 | context | the draft's accuracy on this text so far: share of its predictions the target judged equal to its own argmax, (right + 1) / (judged + 2) | 0 | 1 |
| 15 | context | the draft's mean max probability over those predictions, (sum + 1/2) / (judged + 1) | 0 | 1 |
| 16 | context | the accuracy of its low-confidence predictions (max probability below 1/2), (right + 1) / (judged + 2) | 0 | 1 |
| 17 | foresee | the draft's max probability for its next proposal (the first token the next step drafts; 1 when done) | 0 | 1 |

``"context"`` is ``"rich"`` plus how well the draft's confidence has been calibrated on this text so
far (14-16): what a fixed fallback threshold cannot know. ``"foresee"`` adds the score of the proposal the
next step's draft run starts with (17): read from the replay trees (``ReplayRunner.peek_draft``), it is the very
number that step's first draft forward computes, so a live decoder that drafts next would have it at no extra cost. A prediction is judged when the target
verifies it: every proposed token up to a rollback, and the one a fallback withheld, compared with
the target's argmax from the same verification (free: no extra forward). Counts are smoothed
towards 1/2 so the first steps do not swing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gymnasium import spaces

from bild_env.decoding.stats import DecodeStats

OBSERVATIONS = ("paper", "rich", "context", "foresee")
_HIGH = {"paper": [1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]}
_HIGH["rich"] = _HIGH["paper"] + [1.0] * 7
_HIGH["context"] = _HIGH["rich"] + [1.0] * 3
_HIGH["foresee"] = _HIGH["context"] + [1.0]
RECENT_WEIGHT = 0.5  # weight of the newest step in the recent acceptance


@dataclass
class EpisodeView:
    """The numbers an observation is made of, kept by the env (scaled by ``observe``)."""

    max_draft_len: int
    prompt_tokens: int
    max_new_tokens: int
    max_rollback: float
    prompt_len: int = 0
    generated: int = 0
    mean_accepted_length: float = 0.0
    bleu: float = 100.0
    latency_ratio: float = 1.0
    fallback: float = 0.0
    rollback: float = 0.0
    last: DecodeStats = field(default_factory=DecodeStats)
    draft_p: float = 1.0
    recent_acceptance: float = 0.5
    regret_per_token: float = 0.0
    guesses: DecodeStats = field(default_factory=DecodeStats)  # the episode's counts of judged draft predictions
    next_p: float = 1.0  # the draft's max probability for its next proposal ("foresee")

    def after_step(self, step: DecodeStats, draft_p: float) -> None:
        """Record what one BiLD step did (``draft_p``: the draft's max probability when its run stopped)."""
        self.last, self.draft_p = step, draft_p
        kept = step.accepted / step.proposed if step.proposed else 0.0
        self.recent_acceptance += RECENT_WEIGHT * (kept - self.recent_acceptance)


def observation_space(kind: str) -> spaces.Box:
    high = np.array(_HIGH[kind], dtype=np.float32)
    return spaces.Box(np.zeros_like(high), high, dtype=np.float32)


def observe(kind: str, v: EpisodeView) -> np.ndarray:
    """The observation vector of kind ``kind`` ("paper" or "rich"), float32, clipped to its space."""
    values = [
        v.mean_accepted_length / (v.max_draft_len + 1),
        v.bleu / 100.0,
        v.latency_ratio,
        v.fallback,
        v.rollback / v.max_rollback,
        v.prompt_len / v.prompt_tokens,
        v.generated / v.max_new_tokens,
    ]
    if kind in ("rich", "context", "foresee"):
        last = v.last
        values += [
            last.proposed / v.max_draft_len,
            last.accepted / last.proposed if last.proposed else 0.0,
            float(last.fallbacks > 0),
            float(last.rollbacks > 0),
            v.draft_p,
            v.recent_acceptance,
            v.regret_per_token / 2.0,
        ]
    if kind in ("context", "foresee"):
        g = v.guesses
        values += [
            (g.guesses_right + 1) / (g.guesses + 2),
            (g.guess_p + 0.5) / (g.guesses + 1),
            (g.low_guesses_right + 1) / (g.low_guesses + 2),
        ]
    if kind == "foresee":
        values.append(v.next_p)
    return np.clip(np.array(values, dtype=np.float32), 0.0, np.array(_HIGH[kind], dtype=np.float32))
