"""SB3 callbacks: the env's own episode metrics in TensorBoard beside SB3's curves, and a run's checkpoints.

``bild/...`` (training episodes): latency per sentence (ms), acceptance rate, mean accepted length,
BLEU, exact match, the mean fallback and rollback thresholds chosen, the episode reward.
``eval/...`` (after each evaluation on validation prompts): the same means, next to SB3's
``eval/mean_reward``. With the replay backend, ``replay/...``: the share of the questions answered
from the training envs' tree store since the previous episode (``hit_rate``), the prefixes it holds in
memory and the seconds spent running the models to fill the trees so far.

``Checkpoints`` saves a checkpoint every ``--checkpoint-freq`` steps, at the first point after it where the
run's state is whole (the start of the next rollout), and stops training there when asked (``StopRequest``:
Ctrl-C, SIGTERM). ``KeepBestModel`` keeps every new best model of the evaluations with the step it was
evaluated at, so a resumed run can go back to the best model of the steps it keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.runs import save_best_model
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
                if "cost_profile" in info:  # what the rewards were charged by (TensorBoard: text)
                    self.logger.record(f"{self.prefix}/cost_profile", info["cost_profile"], exclude=("stdout", "log", "csv", "json"))
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


class StopRequest:
    """Set by a signal handler (Ctrl-C, SIGTERM); ``Checkpoints`` stops training at the next whole state."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        self.reason = reason


class StopAtCheckpoint(Exception):
    """Raised out of ``model.learn`` by ``Checkpoints`` when a stop was requested: the state is whole here."""


class Checkpoints(BaseCallback):
    """Calls ``save()`` every ``every`` calls (vectorised steps), at the next start of a rollout.

    A step's transitions are stored and learned from after the callbacks of that step, so the state is whole
    only between rollouts: for DQN and SAC (a rollout of ``train_freq`` steps) the same step or a few later,
    for PPO and A2C the end of the rollout under way (its transitions are learned from, not lost). A
    ``StopRequest`` stops training at the same point (``StopAtCheckpoint``), after the due checkpoint if any.
    Its ``n_calls`` must count from the run's start (``agents.training.make_callbacks`` sets it on resume).
    """

    def __init__(self, save: Callable[[], object], every: int, stop: StopRequest | None = None) -> None:
        super().__init__()
        self.save, self.every, self.stop = save, every, stop
        self.due = False

    def _on_step(self) -> bool:
        if self.n_calls % self.every == 0:
            self.due = True
        return True

    def _on_rollout_start(self) -> None:
        if self.due:
            self.save()
            self.due = False
        if self.stop is not None and self.stop.requested:
            raise StopAtCheckpoint(self.stop.reason)


class KeepBestModel(BaseCallback):
    """``EvalCallback``'s ``callback_on_new_best``: saves the new best model as ``best_model.zip`` with its step and
    mean return in ``best_model.json``, and a copy under ``checkpoints/`` (``agents.runs.save_best_model``)."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)

    def _on_step(self) -> bool:
        save_best_model(self.model, self.run_dir, self.parent.best_mean_reward)
        return True
