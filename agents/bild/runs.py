"""BiLD-v1's run folders (``python train.py``): its checkpoints' names, its config, its evaluations and its curves.

A run writes ``<log_dir>/<run_name>/``: ``config.json`` (``save_config``), TensorBoard events and ``progress.csv``
(read back by ``summarize``), ``checkpoints/`` (``agents.common.checkpoints``: per checkpoint the model, the replay
buffer of DQN and SAC, and the resume state of ``agents.bild.resume``, written last), ``evaluations.npz``
(``Evaluations``), ``best_model.zip`` with its step in ``best_model.json`` and ``model.zip``. ``layout`` names a
run's checkpoint files, by which ``checkpoints`` and the trainer (``agents.training.Room``) find them;
``discard_after`` then removes what a killed run wrote after it (checkpoints, evaluations, best models of the branch
thrown away). ``run_config_of`` reads a trained agent's config back for evaluation.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import gymnasium as gym
import numpy as np
import stable_baselines3
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents.algos import off_policy
from agents.common import checkpoints as cps
from agents.common.checkpoints import Checkpoint, Layout
from agents.common.files import write_atomic, write_text_atomic
from agents.common.folders import restore_best_model
from agents.config import ConfigError, RunConfig
from agents.spec import RunSpec, spec_file

CHECKPOINT_PREFIX = "dqn"  # checkpoints/<algo>_<steps>_steps.zip (and <algo>_replay_buffer_<steps>_steps.pkl), e.g. dqn_...
CHECKPOINT_FORMAT = "state last"  # config.json's meta: checkpoints complete with their state (older runs wrote none)
EVAL_TAGS = ("eval/mean_reward", "eval/bleu")  # summarize: by step
TRAIN_TAGS = ("bild/episode_reward", "bild/bleu", "replay/hit_rate")  # summarize: means of tenths


def layout(run_dir: Path, algo: str | None = None) -> Layout:
    """How the run in ``run_dir`` names its checkpoints: by its algorithm (its spec's; runs from before ``--algo``
    trained a DQN). A run of an older version (no ``checkpoints`` in its spec's meta, and no state file) wrote no
    state: its checkpoints are complete without."""
    try:
        spec = RunSpec.load(run_dir)
    except ValueError:
        spec = RunSpec("", {}, CHECKPOINT_PREFIX)
    algo = algo or spec.algo
    older = spec.meta.get("checkpoints") != CHECKPOINT_FORMAT and not any(
        name.kind == "state" for _, name in cps.checkpoint_files(run_dir / "checkpoints"))
    return Layout(algo, algo, off_policy(algo), stateless=older and (run_dir / "config.json").is_file())


def checkpoint_paths(run_dir: Path, steps: int, algo: str = CHECKPOINT_PREFIX) -> Checkpoint:
    """The files of the checkpoint at ``steps`` of a run of ``algo``."""
    return cps.checkpoint_at(run_dir, steps, Layout(algo, algo, off_policy(algo)))


def checkpoints(run_dir: Path, algo: str | None = None) -> list[Checkpoint]:
    """Every complete checkpoint (unread), newest (most steps) first."""
    return cps.complete_checkpoints(run_dir, layout(run_dir, algo))


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The complete checkpoint with the most steps (unread: ``resume_point``)."""
    found = checkpoints(run_dir)
    return found[0] if found else None


def save_config(config: RunConfig, path: Path) -> None:
    """The run's spec (``RunConfig.spec``), with the command line, the time and the library versions under ``meta``;
    written whole, then renamed: a kill never leaves half a config."""
    meta = {"argv": sys.argv, "checkpoints": CHECKPOINT_FORMAT, "saved": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": {
        "python": platform.python_version(), "torch": torch.__version__,
        "stable_baselines3": stable_baselines3.__version__, "gymnasium": gym.__version__}}
    write_text_atomic(path, config.spec(meta).text())


# -- evaluations ---------------------------------------------------------------------------------------
@dataclass
class Evaluations:
    """SB3's ``EvalCallback`` record: the step of each evaluation, and each episode's return and length."""

    timesteps: list[int] = field(default_factory=list)
    results: list[list[float]] = field(default_factory=list)
    lengths: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, callback) -> Evaluations:
        return cls(list(callback.evaluations_timesteps), [list(map(float, r)) for r in callback.evaluations_results],
                   [list(map(int, n)) for n in callback.evaluations_length])

    def to(self, callback) -> None:
        """Give ``callback`` (an ``EvalCallback``) these evaluations and their best mean return."""
        callback.evaluations_timesteps = list(self.timesteps)
        callback.evaluations_results = [list(r) for r in self.results]
        callback.evaluations_length = [list(n) for n in self.lengths]
        best = self.best()
        callback.best_mean_reward = -np.inf if best is None else best[1]
        if self.results:
            callback.last_mean_reward = float(np.mean(self.results[-1]))

    def upto(self, steps: int) -> Evaluations:
        keep = [i for i, t in enumerate(self.timesteps) if t <= steps]
        return Evaluations([self.timesteps[i] for i in keep], [self.results[i] for i in keep],
                           [self.lengths[i] for i in keep])

    def best(self) -> tuple[int, float] | None:
        """(step, mean return) of the best evaluation by ``EvalCallback``'s rule (the first to beat all: ``max``'s)."""
        means = [(int(t), float(np.mean(r))) for t, r in zip(self.timesteps, self.results)]
        return max(means, key=lambda point: point[1], default=None)

    def to_dict(self) -> dict[str, list]:
        return {"timesteps": self.timesteps, "results": self.results, "lengths": self.lengths}

    @classmethod
    def from_dict(cls, data: dict[str, list]) -> Evaluations:
        return cls([int(t) for t in data["timesteps"]], [list(map(float, r)) for r in data["results"]],
                   [list(map(int, n)) for n in data["lengths"]])

    def save(self, path: Path) -> None:
        def write(f: BinaryIO) -> None:
            episodes = len(self.results[0]) if self.results else 0
            np.savez(f, timesteps=np.asarray(self.timesteps, dtype=np.int64),
                     results=np.asarray(self.results, dtype=np.float64).reshape(len(self.results), episodes),
                     ep_lengths=np.asarray(self.lengths, dtype=np.int64).reshape(len(self.lengths), episodes))

        write_atomic(path, write)

    @classmethod
    def read(cls, path: Path) -> Evaluations:
        """The evaluations in ``path`` (SB3's evaluations.npz); empty, with a message, when it cannot be read."""
        if not path.is_file():
            return cls()
        try:
            with np.load(path) as saved:
                return cls(saved["timesteps"].tolist(), saved["results"].tolist(), saved["ep_lengths"].tolist())
        except Exception as err:  # a file cut short by a kill raises several types
            print(f"train.py: ignoring {path}, which cannot be read ({type(err).__name__}: {err}); the evaluations "
                  "start again from here", file=sys.stderr, flush=True)
            return cls()




def discard_after(run_dir: Path, steps: int, evaluations: Evaluations, say: Callable[[str], None]) -> None:
    """Before resuming at ``steps``: remove what the run wrote after it, on the branch the resume throws away.

    Checkpoint files of later steps and temporary files go (``agents.common.checkpoints.discard_after``);
    ``evaluations.npz`` is rewritten with ``evaluations`` (those up to ``steps``), and ``best_model.zip`` is the best
    of them again (its copy under ``checkpoints/``). ``say`` reports each change.
    """
    cps.discard_after(run_dir, steps, say)
    if evaluations.timesteps:
        evaluations.save(run_dir / "evaluations.npz")
    elif (run_dir / "evaluations.npz").exists():  # every evaluation was after the checkpoint
        (run_dir / "evaluations.npz").unlink()
    restore_best_model(run_dir, evaluations.best(), say)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None  # None: too few points for that tenth


def summarize(run_dir: str | Path) -> dict:
    """A run's learning curves in numbers, from its TensorBoard events.

    ``EVAL_TAGS`` (each evaluation on validation prompts): ``{step: value}``. ``TRAIN_TAGS``
    (per-episode training scalars): the number of points and their means over the first, fifth
    and last tenth of them.
    """
    if not any(Path(run_dir).glob("events.out.tfevents.*")):
        what = "no TensorBoard events" if Path(run_dir).is_dir() else "no such folder"
        raise ConfigError(f"{run_dir}: {what}; give a run folder (logs/<run_name>) that train.py has written to")
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = set(events.Tags()["scalars"])
    out: dict = {}
    for tag in EVAL_TAGS:
        if tag in tags:
            out[tag] = {e.step: round(e.value, 3) for e in events.Scalars(tag)}
    for tag in TRAIN_TAGS:
        if tag in tags:
            values = [e.value for e in events.Scalars(tag)]
            k = max(1, len(values) // 10)
            out[tag] = {"points": len(values), "first tenth": _mean(values[:k]),
                        "fifth tenth": _mean(values[4 * k : 5 * k]), "last tenth": _mean(values[-k:])}
    return out


def run_pair(run: Path) -> str | None:
    """The model pair preset a run folder was trained on (its spec), or None when unreadable."""
    try:
        return RunSpec.load(run).env.get("pair")
    except ValueError:
        return None


def run_config_of(model_path: str | Path) -> RunConfig | None:
    """The config of the run a model file (or run folder) belongs to (``agents.spec.spec_file``); None for a model
    without one. A ``ConfigError`` naming the file when it cannot be read."""
    path = spec_file(model_path)
    try:
        return None if path is None else RunConfig.load(path)
    except ValueError as err:  # a UsageError naming the file: ConfigError, as the evaluations' errors are
        raise ConfigError(str(err)) from None
