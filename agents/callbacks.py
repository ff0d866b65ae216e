"""SB3 callbacks that log the env's own episode metrics to TensorBoard, beside SB3's curves.

``bild/...`` (training episodes): latency per sentence (ms), acceptance rate, mean accepted length,
BLEU, exact match, the mean fallback and rollback thresholds chosen, the episode reward.
``eval/...`` (after each evaluation on validation prompts): the same means, next to SB3's
``eval/mean_reward``. With the replay backend, ``replay/...``: the share of the questions answered
from the training envs' tree store since the previous episode (``hit_rate``), the prefixes it holds in
memory and the seconds spent running the models to fill the trees so far. ``PruneReplayBuffers`` keeps
the checkpoint folder from growing without bound (``agents.runs.prune_replay_buffers``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.runs import prune_replay_buffers
from agents.wrappers import RecordSummaries

SUMMARY_KEYS = ("latency_ms", "acceptance_rate", "mean_accepted_length", "bleu", "exact_match", "regret", "fidelity",
                "mean_fallback", "mean_rollback", "new_tokens")


class EpisodeMetricsCallback(BaseCallback):
    """Records ``bild/<key>`` for every finished training episode (``record_mean``: SB3 writes them at its
    next dump, every ``log_interval`` episodes, as the mean over those episodes)."""

    def __init__(self, prefix: str = "bild", replay_store=None) -> None:
        super().__init__()
        self.prefix = prefix
        self.errors = 0
        self.store = replay_store  # the training envs' TreeStore (None: live backend)
        self.seen = (0, 0)  # its hits and misses at the previous episode end

    def _record_replay(self) -> None:
        c = self.store.counts
        hits, misses = c.hits - self.seen[0], c.misses - self.seen[1]
        self.seen = (c.hits, c.misses)
        if hits + misses:
            self.logger.record_mean("replay/hit_rate", hits / (hits + misses))
        self.logger.record("replay/prefixes", self.store.nodes)
        self.logger.record("replay/fill_seconds", c.fill_ms / 1000.0)

    def _on_step(self) -> bool:
        for info in self.locals["infos"]:
            summary = info.get("episode_summary")
            if summary is not None:
                if self.store is not None:
                    self._record_replay()
                for key in SUMMARY_KEYS:
                    self.logger.record_mean(f"{self.prefix}/{key}", float(summary[key]))
                if "episode" in info:  # added by SB3's Monitor wrapper
                    self.logger.record_mean(f"{self.prefix}/episode_reward", float(info["episode"]["r"]))
            if "error" in info:  # a model failure truncated the episode
                self.errors += 1
                self.logger.record(f"{self.prefix}/model_errors", self.errors)
        return True


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
            self.logger.dump(self.num_timesteps)  # EvalCallback has dumped its own keys already
        return True


class PruneReplayBuffers(BaseCallback):
    """After each checkpoint (put it after SB3's ``CheckpointCallback``, with the same ``save_freq``), keep only
    the newest ``keep`` replay buffers: each holds up to ``buffer_size`` transitions, model checkpoints are small."""

    def __init__(self, folder: str | Path, save_freq: int, keep: int) -> None:
        super().__init__()
        self.folder, self.save_freq, self.keep = Path(folder), save_freq, keep

    def _on_step(self) -> bool:
        if self.keep > 0 and self.n_calls % self.save_freq == 0:
            prune_replay_buffers(self.folder, self.keep)
        return True
