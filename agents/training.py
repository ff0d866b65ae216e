"""The trainer of ``python train.py``, one for every env.

``train.py`` (``agents.commands.train_main``) takes ``--env`` (a preset of ``agents.spec.PRESETS``; with ``--resume
RUN``, the run's spec) off the command line and hands the rest to the ``Room`` of that preset's env, which parses it
by its ``options`` (one skeleton, ``agents.common.parse``): ``agents.bild.training.BildRoom`` (BiLD-v1) or
``agents.serve.training.ServeRoom`` (BiLD-Serve-v0); ``run`` then trains it, and ``train`` is the run, the same for
both (each room's checkpoints found by its ``layout``, ``algorithm`` and ``read_state``):

1. the run folder's lock (``train.lock``: one process per run), and where the run starts, one rule
   (``agents.common.folders.check_start``): from the newest checkpoint whose files load with ``--resume``, else from
   step 0, what an earlier attempt wrote set aside in ``set_aside/<n>/``;
2. the room's envs (``setup``: for the serving env the main job's phases) and model, new or loaded;
3. the logger (TensorBoard and ``progress.csv``, continued from the checkpoint's step on resume), the room's
   resume state (``restore``), its callbacks and the checkpoints every ``checkpoint_freq`` steps, all counting from
   the run's start, so that they fall where the uninterrupted run's did;
4. ``model.learn`` up to the total: Ctrl-C or SIGTERM stops it at the next checkpoint boundary with a checkpoint, a
   second one at once (the run then resumes from its last checkpoint); then the final checkpoint and, for a run
   that was not stopped, ``model.zip`` (a run resumed at its total trains nothing and writes its end again);
5. the room's end (``finish``: the serving env's floor and summary), its envs closed.

What a room adds is what its env's runs differ in, as Stable-Baselines3 keeps one loop and varies algorithms by
subclass and callback.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ProgressBarCallback
from stable_baselines3.common.vec_env import VecEnv

from agents.common.callbacks import (Checkpoints, StopAtCheckpoint, StopRequest, sigterm_as_ctrl_c,
                                     stop_on_signals)
from agents.common.checkpoints import Checkpoint, Layout, complete_checkpoints, resume_point, save_checkpoint
from agents.common.files import write_atomic
from agents.common.folders import check_start, resume_hint, set_aside
from agents.common.lock import RunLock
from agents.common.parse import TrainOptions
from agents.config import ConfigError


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    interrupted: str | None  # the signal that stopped training at a checkpoint; None where the run reached its end
    checkpoint: Checkpoint  # the last one saved
    table: list[dict] = field(default_factory=list)  # the room's result rows (the serving env: agent against rules)


class Room:
    """What the runs of one env differ in: a subclass is made from its command line (``from_argv``) or its config,
    sets the attributes below, and gives the steps ``train`` calls in order."""

    env_id: str
    run_dir: Path
    resume: bool  # --resume: go on from the newest readable checkpoint (from step 0 where there is none)
    total: int  # env steps over all envs
    n_envs: int
    checkpoint_freq: int  # env steps between checkpoints
    progress_bar: bool = False  # SB3's bar (tqdm and rich)
    log_interval: int = 4  # episodes between SB3's rollout/ records (on-policy: rollouts)
    stdout: bool = False  # SB3's tables on stdout too
    options: type[TrainOptions]  # its command line (``agents.common.parse``)
    layout: Layout  # how its checkpoints' files are named (``agents.common.checkpoints``)
    algorithm: type[BaseAlgorithm]  # whose ``load`` reads a checkpoint's model
    read_state: Callable[[Path, int], object]  # a checkpoint's state (path, steps), checked: raises where unusable
    keep: int = 2  # complete checkpoints that keep their replay buffer and state (0: all)

    @classmethod
    def from_argv(cls, argv: list[str] | None, preset: str | None = None) -> Room:
        """The room of a run from ``train.py``'s arguments (``--env`` taken off) and the preset ``--env`` named: a new
        run from the preset's options, or ``--resume RUN``'s (``options``); exits with a message on bad options."""
        return cls(*cls.options.parse(argv, preset))

    def say(self, message: str) -> None:
        print(f"train.py: {message}", flush=True)

    def warn(self, message: str) -> None:
        print(f"train.py: {message}", file=sys.stderr, flush=True)

    skipped = warn  # where a checkpoint that cannot be read is named (the serving env: stdout, ``say``)

    def checkpoints(self) -> list[Checkpoint]:
        """The run's complete checkpoints (unread), newest first."""
        return complete_checkpoints(self.run_dir, self.layout)

    def start_point(self) -> Checkpoint | None:
        """The newest checkpoint whose files load (each newer one skipped named by ``skipped``), or None."""
        return resume_point(self.run_dir, self.layout, lambda path: self.algorithm.load(path, device="cpu"),
                            self.read_state, self.skipped)

    def setup(self, start: Checkpoint | None) -> VecEnv:
        """The envs (the training ones returned), and the run's config written where it may have changed."""
        raise NotImplementedError

    def make_model(self, env: VecEnv, start: Checkpoint | None) -> BaseAlgorithm:
        """A new model, or the one of checkpoint ``start`` with its replay buffer."""
        raise NotImplementedError

    def restore(self, model: BaseAlgorithm, start: Checkpoint) -> None:
        """On resume, after the logger is set: the room's state as it stood at ``start``; what a killed run wrote after
        it removed."""

    def callbacks(self, model: BaseAlgorithm, stop: StopRequest) -> list[BaseCallback]:
        """The room's callbacks (the checkpoints and the progress bar are added after them)."""
        return []

    def before_learn(self, model: BaseAlgorithm) -> None:
        """Last before training (BiLD-v1 sets the envs' episodes and generators of the checkpoint here)."""

    def training(self, model: BaseAlgorithm) -> contextlib.AbstractContextManager:
        """What training runs inside (the serving env: its phase's progress line)."""
        return contextlib.nullcontext()

    def save_checkpoint(self, model: BaseAlgorithm) -> Checkpoint:
        """The checkpoint at ``model.num_timesteps``: the model, its replay buffer, and the room's ``state_of`` last."""
        return save_checkpoint(model, self.run_dir, self.layout, self.state_of(model), self.keep)

    def state_of(self, model: BaseAlgorithm) -> dict:
        """What a checkpoint holds besides the model and its buffer (written last: it completes the checkpoint)."""
        raise NotImplementedError

    def settle(self, model: BaseAlgorithm, stop: StopRequest, interrupted: str | None) -> str | None:
        """Why training stopped before its end (None: it reached it), once ``learn`` has returned: a signal in the last
        rollout stops the run too."""
        return stop.reason if interrupted is None and stop.requested else interrupted

    def finish(self, model: BaseAlgorithm, interrupted: str | None) -> list[dict]:
        """After the final checkpoint, the envs still open: the room's results."""
        return []

    def close(self) -> None:
        """Close the envs (on every path out of ``train``)."""

    def report(self, result: TrainResult) -> None:
        """What ``run`` prints of a run that reached its end."""

    def end(self) -> None:
        """On every path out of ``run``."""


def train(room: Room) -> TrainResult:
    """Train the room's run (new, or ``room.resume``) up to ``room.total`` env steps, under the run folder's lock
    (``RunInUse``, a ``ConfigError``, at once when another process holds it)."""
    run_dir = room.run_dir
    lock = RunLock.acquire(run_dir)
    try:
        start = room.start_point() if (run_dir / "config.json").is_file() else None
        check_start(run_dir, room.resume, start, room.total, room.say, room.env_id)
        if start is None and (aside := set_aside(run_dir)) is not None:
            room.say(f"what the earlier attempt wrote (models, logs, evaluations, checkpoints) is kept in {aside}")
        print(f"resuming at step {start.steps}: {run_dir}" if start else f"new run: {run_dir}",
              f"({room.total} steps in all)", flush=True)
        if start is not None and start.steps >= room.total:  # finished, or killed while writing its end
            room.say(f"the run has trained its {room.total} steps: only its end is written again (its final model and, "
                     f"where the env has them, its evaluations); give --total-timesteps above {start.steps} to train "
                     "longer")
        try:
            return _train(room, start)
        finally:
            room.close()
    finally:  # a start that failed before its config was written leaves no folder behind
        lock.release(remove_empty_folder=not (run_dir / "config.json").exists())


def _train(room: Room, start: Checkpoint | None) -> TrainResult:
    from agents.common.logs import make_logger

    env = room.setup(start)
    model = room.make_model(env, start)
    model.set_logger(make_logger(room.run_dir, None if start is None else start.steps, room.say, stdout=room.stdout))
    try:
        if start is not None:
            room.restore(model, start)
        last = [start] if start is not None else []

        def checkpoint() -> Checkpoint:
            if not last or last[-1].steps != model.num_timesteps:  # not saved at this step already
                last.append(room.save_checkpoint(model))
            return last[-1]

        stop, interrupted = StopRequest(), None
        with room.training(model):
            callbacks = [*room.callbacks(model, stop),
                         Checkpoints(checkpoint, max(1, room.checkpoint_freq // room.n_envs), stop)]
            if room.progress_bar:
                callbacks.append(ProgressBarCallback())
            for callback in callbacks:  # SB3 counts calls (vectorised steps) from 0 in each process
                callback.n_calls = model.num_timesteps // room.n_envs
            room.before_learn(model)
            try:
                with stop_on_signals(stop):
                    if model.num_timesteps < room.total:
                        model.learn(room.total - model.num_timesteps, callback=CallbackList(callbacks),
                                    log_interval=room.log_interval, reset_num_timesteps=start is None)
            except StopAtCheckpoint as why:
                interrupted = str(why)
            finally:  # SB3 closes its bar only when training ends normally: leave the terminal clean
                for callback in callbacks:
                    if isinstance(callback, ProgressBarCallback) and hasattr(callback, "pbar"):
                        callback.pbar.close()
            interrupted = room.settle(model, stop, interrupted)
            saved = checkpoint()
            if interrupted is None:
                write_atomic(room.run_dir / "model.zip", model.save)
    finally:
        model.logger.close()  # flushes the TensorBoard events
    table = room.finish(model, interrupted)
    return TrainResult(room.run_dir, int(model.num_timesteps), interrupted, saved, table)


def run(room: Room) -> int:
    """``train.py``'s run of ``room``, with its messages: exit status 0 at the run's end, 2 on a refusal, 130 when
    stopped."""
    try:
        with sigterm_as_ctrl_c():
            result = train(room)
        if result.interrupted:
            saved = result.checkpoint
            print(f"interrupted at step {result.steps} ({result.interrupted}): saved {saved.model.name}"
                  + (" and its replay buffer" if saved.replay_buffer else "")
                  + f"; continue with: {resume_hint(result.run_dir)}", file=sys.stderr, flush=True)
            return 130
        room.report(result)
        return 0
    except (ConfigError, FileExistsError) as err:
        print(f"train.py: error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C / SIGTERM during it
        found = room.checkpoints() if (room.run_dir / "config.json").is_file() else []
        then = (f"continue from step {found[0].steps} with `{resume_hint(room.run_dir)}`" if found
                else "start it again (the same command)")
        print(f"train.py: stopped at once, nothing saved since the last checkpoint; {then}", file=sys.stderr,
              flush=True)
        return 130
    finally:
        room.end()
