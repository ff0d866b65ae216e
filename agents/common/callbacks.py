"""SB3 callbacks both trainers use: the env's episode metrics in TensorBoard beside SB3's curves, a run's
checkpoints, its best model, and the signals that stop it.

``EpisodeMetrics`` records the means of the finished training episodes' summaries (``info["episode_summary"]``)
under a prefix (BiLD-v1: ``bild/``, ``agents.bild.callbacks``; the serving env: ``serve/``).
``Checkpoints`` saves a checkpoint every ``--checkpoint-freq`` steps, at the first point after it where the
run's state is whole (the start of the next rollout), and stops training there when asked (``StopRequest``:
Ctrl-C, SIGTERM; ``stop_on_signals``). ``KeepBestModel`` keeps every new best model of the evaluations with the step
it was evaluated at, so a resumed run can go back to the best model of the steps it keeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stable_baselines3.common.callbacks import BaseCallback

from agents.common.folders import save_best_model
from bild_env.command import sigterm_as_ctrl_c  # noqa: F401 - the trainers' outside training (loading, envs)

TEXT_ONLY = ("stdout", "log", "csv", "json")  # a logged text (the cost profile): TensorBoard only


class EpisodeMetrics(BaseCallback):
    """Records ``<prefix>/<name>`` for every finished training episode, one per summary key in ``keys`` (``{key:
    name}``), and the cost profile its rewards were charged by (``record_mean``: SB3 writes them at its next dump,
    as the mean over the episodes since the last one). ``cost_profile``: what is logged when the info names none
    (None: nothing)."""

    def __init__(self, prefix: str, keys: dict[str, str], cost_profile: str | None = None) -> None:
        super().__init__()
        self.prefix, self.keys, self.cost_profile = prefix, keys, cost_profile

    def on_episode(self, info: dict, summary: dict) -> None:
        """Called for every finished episode before its summary is recorded (nothing here)."""

    def on_info(self, info: dict) -> None:
        """Called for every step's info (nothing here)."""

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            summary = info.get("episode_summary")
            if summary:
                self.on_episode(info, summary)
                for key, name in self.keys.items():
                    self.logger.record_mean(f"{self.prefix}/{name}", float(summary[key]))
                profile = info.get("cost_profile", self.cost_profile)
                if profile is not None:  # what the rewards were charged by (TensorBoard: text)
                    self.logger.record(f"{self.prefix}/cost_profile", profile, exclude=TEXT_ONLY)
            self.on_info(info)
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


class TimeBudget(BaseCallback):
    """Requests a stop (``stop``: ``Checkpoints`` ends training at the next whole state) once the clock reaches
    ``deadline`` less what finishing takes (``reserve_s()``: e.g. the longest evaluation so far), but never before
    ``min_steps``. ``stopped_at`` is the step it asked at (None: it did not). ``clock`` (monotonic seconds) is for
    tests."""

    REASON = "the time budget"

    def __init__(self, deadline: float, stop: StopRequest, min_steps: int = 0,
                 reserve_s: Callable[[], float] = lambda: 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.deadline, self.stop, self.min_steps, self.reserve_s, self.clock = deadline, stop, min_steps, reserve_s, clock
        self.stopped_at: int | None = None

    def _on_step(self) -> bool:
        if (self.stopped_at is None and not self.stop.requested and self.num_timesteps >= self.min_steps
                and self.clock() >= self.deadline - self.reserve_s()):
            self.stopped_at = self.num_timesteps
            self.stop.request(self.REASON)
        return True


class StopAtCheckpoint(Exception):
    """Raised out of ``model.learn`` by ``Checkpoints`` when a stop was requested: the state is whole here."""


class Checkpoints(BaseCallback):
    """Calls ``save()`` every ``every`` calls (vectorised steps), at the next start of a rollout.

    A step's transitions are stored and learned from after the callbacks of that step, so the state is whole
    only between rollouts: for DQN and SAC (a rollout of ``train_freq`` steps) the same step or a few later,
    for PPO and A2C the end of the rollout under way (its transitions are learned from, not lost). A
    ``StopRequest`` stops training at the same point (``StopAtCheckpoint``), after the due checkpoint if any.
    Its ``n_calls`` must count from the run's start (both trainers set it on resume).
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
    mean return in ``best_model.json``, and a copy under ``checkpoints/`` (``agents.common.folders.save_best_model``)."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)

    def _on_step(self) -> bool:
        save_best_model(self.model, self.run_dir, self.parent.best_mean_reward)
        return True


def say_now(text: str) -> None:
    """Write to stderr from a signal handler: unbuffered where stderr is a file descriptor (not under capture)."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError, io.UnsupportedOperation):
        sys.stderr.write(text)


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest):
    """While training: the first Ctrl-C or SIGTERM asks ``stop`` to end training at the next checkpoint boundary
    (a few steps; for PPO and A2C the end of the rollout under way); a second one stops at once
    (``KeyboardInterrupt``). A SIGINT that the process was started to ignore stays ignored."""
    def handler(signum, frame):
        name = signal.Signals(signum).name
        if stop.requested:
            raise KeyboardInterrupt(name)
        stop.request(name)
        say_now(f"\ntrain.py: {name}: stopping at the next checkpoint boundary (with a checkpoint); "
                f"{name} again stops at once, losing the steps since the last one\n")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
