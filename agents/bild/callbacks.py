"""BiLD-v1's episode metrics in TensorBoard beside SB3's curves.

``bild/...`` (training episodes): latency per sentence (ms), acceptance rate, mean accepted length,
BLEU, exact match, the mean fallback and rollback thresholds chosen, the episode reward.
``eval/...`` (after each evaluation on validation prompts): the same means, next to SB3's
``eval/mean_reward``. With the replay backend, ``replay/...``: the share of the questions answered
from the training envs' tree store since the previous episode (``hit_rate``), the prefixes it holds in
memory and the seconds spent running the models to fill the trees so far.
"""

from __future__ import annotations

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.common.callbacks import EpisodeMetrics
from agents.common.logs import STEP_KEY
from agents.wrappers import RecordSummaries

SUMMARY_KEYS = ("latency_ms", "acceptance_rate", "mean_accepted_length", "bleu", "exact_match", "regret", "fidelity",
                "mean_fallback", "mean_rollback", "new_tokens")


class EpisodeMetricsCallback(EpisodeMetrics):
    """Records ``bild/<key>`` for every finished training episode (``record_mean``: SB3 writes them at its
    next dump, every ``log_interval`` episodes, as the mean over those episodes)."""

    def __init__(self, prefix: str = "bild", replay_store=None) -> None:
        super().__init__(prefix, {key: key for key in SUMMARY_KEYS})
        self.errors = 0
        self.store = replay_store  # the training envs' TreeStore (None: live backend)
        self.seen = (0, 0)  # its hits and misses at the previous episode end

    def on_episode(self, info: dict, summary: dict) -> None:
        if self.store is not None:
            c = self.store.counts
            hits, misses = c.hits - self.seen[0], c.misses - self.seen[1]
            self.seen = (c.hits, c.misses)
            if hits + misses:
                self.logger.record_mean("replay/hit_rate", hits / (hits + misses))
            self.logger.record("replay/prefixes", self.store.nodes)
            self.logger.record("replay/fill_seconds", c.fill_ms / 1000.0)
        if "episode" in info:  # added by SB3's Monitor wrapper
            self.logger.record_mean(f"{self.prefix}/episode_reward", float(info["episode"]["r"]))

    def on_info(self, info: dict) -> None:
        if "error" in info:  # a model failure truncated the episode
            self.errors += 1
            self.logger.record(f"{self.prefix}/model_errors", self.errors)


class EvalMetricsCallback(BaseCallback):
    """Run by ``EvalCallback`` after each evaluation: logs the means of the evaluation episodes' summaries.

    ``recorder`` is the ``RecordSummaries`` wrapper inside the evaluation env.
    """

    def __init__(self, recorder: RecordSummaries, prefix: str = "eval") -> None:
        super().__init__()
        self.recorder = recorder
        self.prefix = prefix

    def _on_step(self) -> bool:
        summaries = self.recorder.pop_summaries()
        if summaries:
            for key in SUMMARY_KEYS:
                self.logger.record(f"{self.prefix}/{key}", float(np.mean([s[key] for s in summaries])))
            self.logger.record(STEP_KEY, self.num_timesteps, exclude="tensorboard")  # every progress.csv row says its step
            self.logger.dump(self.num_timesteps)  # EvalCallback has dumped its own keys already
        return True
