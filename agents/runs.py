"""Run folders: where a training run's files lie, and reading them back.

A run writes ``<log_dir>/<run_name>/``: ``config.json`` (``save_config``), TensorBoard events
(read back by ``summarize``), ``checkpoints/`` (``checkpoint_paths``: SB3's ``CheckpointCallback``
names, parsed by ``parse_checkpoint_name``; ``prune_replay_buffers`` keeps the newest replay
buffers only), ``evaluations.npz`` (``restore_evaluations`` on resume), ``best_model.zip`` and
``model.zip``. ``find_run`` and ``intact_checkpoint`` (the newest checkpoint that loads, past
truncated or garbled ones) find what ``--resume`` continues from;
``check_log_dir`` fails early when runs cannot be written. ``choose_model``, ``run_config_of`` and
``load_agent`` read a trained agent back for evaluation (``evaluate.py``, ``bench.headroom``).
"""

from __future__ import annotations

import json
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import stable_baselines3
import torch
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.save_util import load_from_pkl, load_from_zip_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents.algos import ALGO_CLASSES, algo_class, off_policy
from agents.config import ConfigError, RunConfig

CHECKPOINT_PREFIX = "dqn"  # checkpoints/<algo>_<steps>_steps.zip (and <algo>_replay_buffer_<steps>_steps.pkl), e.g. dqn_...
# SB3's CheckpointCallback names: <prefix>_<steps>_steps.zip (model), <prefix>_replay_buffer_<steps>_steps.pkl
_CHECKPOINT_NAME = re.compile(r"(?P<prefix>.+?)_(?:replay_buffer_(?P<buffer>\d+)_steps\.pkl|(?P<model>\d+)_steps\.zip)")
EVAL_TAGS = ("eval/mean_reward", "eval/bleu")  # summarize: by step
TRAIN_TAGS = ("bild/episode_reward", "bild/bleu", "replay/hit_rate")  # summarize: means of tenths


@dataclass(frozen=True)
class Checkpoint:
    """A saved model and its replay buffer (None for an on-policy algorithm) after ``steps`` env steps."""

    model: Path
    replay_buffer: Path | None
    steps: int


@dataclass(frozen=True)
class CheckpointName:
    """What a checkpoint file's name says: its prefix, its step count, model (.zip) or replay buffer (.pkl)."""

    prefix: str
    steps: int
    replay_buffer: bool


def parse_checkpoint_name(name: str) -> CheckpointName | None:
    """``<prefix>_<steps>_steps.zip`` or ``<prefix>_replay_buffer_<steps>_steps.pkl``; None for other names."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    buffer = match.group("buffer")
    return CheckpointName(match.group("prefix"), int(buffer or match.group("model")), buffer is not None)


def checkpoint_files(folder: str | Path) -> Iterator[tuple[Path, CheckpointName]]:
    """Every file in ``folder`` named as a checkpoint, with what its name says."""
    for path in Path(folder).glob("*_steps.*"):
        name = parse_checkpoint_name(path.name)
        if name is not None:
            yield path, name


def checkpoint_paths(run_dir: Path, steps: int, algo: str = CHECKPOINT_PREFIX) -> Checkpoint:
    """Names as SB3's CheckpointCallback writes them (with the algorithm's name as prefix)."""
    folder = run_dir / "checkpoints"
    buffer = folder / f"{algo}_replay_buffer_{steps}_steps.pkl" if off_policy(algo) else None
    return Checkpoint(folder / f"{algo}_{steps}_steps.zip", buffer, steps)


def run_algo(run_dir: Path) -> str:
    """The algorithm of the run in ``run_dir`` (its config.json; runs from before ``--algo`` trained a DQN)."""
    try:
        return RunConfig.load(run_dir / "config.json").train.algo
    except (OSError, ValueError, TypeError, KeyError):
        return CHECKPOINT_PREFIX


def checkpoints(run_dir: Path, algo: str | None = None) -> list[Checkpoint]:
    """Every checkpoint whose model (and replay buffer, for DQN and SAC) exist, newest (most steps) first."""
    algo = algo or run_algo(run_dir)
    found = [checkpoint_paths(run_dir, name.steps, algo) for _, name in checkpoint_files(run_dir / "checkpoints")
             if name.prefix == algo and not name.replay_buffer]
    return sorted((c for c in found if c.replay_buffer is None or c.replay_buffer.is_file()),
                  key=lambda c: c.steps, reverse=True)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The checkpoint with the most steps whose model and replay buffer both exist (unread: ``intact_checkpoint``)."""
    found = checkpoints(run_dir)
    return found[0] if found else None


def unreadable(checkpoint: Checkpoint, algo: str = CHECKPOINT_PREFIX) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (the file and the error), or None when its model and buffer load."""
    loaders = [(checkpoint.model, lambda p: algo_class(algo).load(p, device="cpu"))]
    if checkpoint.replay_buffer is not None:
        loaders.append((checkpoint.replay_buffer, load_from_pkl))
    for path, load in loaders:
        try:
            load(path)
        except Exception as err:  # a truncated or garbled file raises many types (BadZipFile, UnpicklingError, ...)
            return f"{path}: {type(err).__name__}: {' '.join(str(err).split())}"  # one line
    return None


def intact_checkpoint(run_dir: Path, skipped: Callable[[str], None]) -> Checkpoint | None:
    """The newest checkpoint whose model and replay buffer both load; ``skipped(why)`` for each newer one that fails."""
    algo = run_algo(run_dir)
    for checkpoint in checkpoints(run_dir, algo):
        why = unreadable(checkpoint, algo)
        if why is None:
            return checkpoint
        skipped(why)
    return None


def prune_replay_buffers(folder: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``*_replay_buffer_<steps>_steps.pkl`` in ``folder`` (0: keep all)."""
    buffers = sorted((name.steps, path) for path, name in checkpoint_files(folder) if name.replay_buffer)
    doomed = [path for _, path in buffers[:-keep]] if keep > 0 else []
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def find_run(run: str, log_dir: Path) -> Path:
    """A run folder given as a path or as a run name under ``log_dir``."""
    for candidate in (Path(run), log_dir / run):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"--resume {run!r}: no run folder with a config.json at {run} or {log_dir / run}")


def check_log_dir(log_dir: Path) -> None:
    """Fail now, not after loading the models, when runs cannot be written under ``log_dir``."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write to --log-dir {str(log_dir)!r}: {err.strerror or err}") from err


def save_config(config: RunConfig, path: Path) -> None:
    """The whole config, with the command line, the time and the library versions under ``meta``."""
    meta = {"argv": sys.argv, "saved": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": {
        "python": platform.python_version(), "torch": torch.__version__,
        "stable_baselines3": stable_baselines3.__version__, "gymnasium": gym.__version__}}
    tmp = path.with_name(path.name + ".tmp")  # written whole, then renamed: a kill never leaves half a config
    tmp.write_text(json.dumps(config.to_dict() | {"meta": meta}, indent=2) + "\n")
    tmp.replace(path)


def restore_evaluations(callback: EvalCallback, path: Path, num_timesteps: int) -> None:
    """On resume: keep the earlier evaluations in evaluations.npz and the best mean reward so far."""
    if not path.is_file():
        return
    try:
        with np.load(path) as saved:
            keep = saved["timesteps"] <= num_timesteps
            timesteps, results, lengths = saved["timesteps"][keep], saved["results"][keep], saved["ep_lengths"][keep]
    except Exception as err:  # a file cut short by a kill raises several types
        print(f"train.py: ignoring {path}, which cannot be read ({type(err).__name__}: {err}); the evaluations "
              "start again from here", file=sys.stderr, flush=True)
        return
    callback.evaluations_timesteps = timesteps.tolist()
    callback.evaluations_results = results.tolist()
    callback.evaluations_length = lengths.tolist()
    if callback.evaluations_results:
        callback.best_mean_reward = max(float(np.mean(r)) for r in callback.evaluations_results)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None  # None: too few points for that tenth


def summarize(run_dir: str | Path) -> dict:
    """A run's learning curves in numbers, from its TensorBoard events.

    ``EVAL_TAGS`` (each evaluation on validation prompts): ``{step: value}``. ``TRAIN_TAGS``
    (per-episode training scalars): the number of points and their means over the first, fifth
    and last tenth of them.
    """
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


def newest_run(log_dir: Path, pair: str | None = None) -> Path | None:
    """The run folder under ``log_dir`` with the newest ``model.zip`` (of ``pair``'s runs when given), or None."""
    runs = [p.parent for p in log_dir.glob("*/model.zip")]
    if pair:
        runs = [r for r in runs if run_pair(r) == pair]
    return max(runs, key=lambda r: (r / "model.zip").stat().st_mtime) if runs else None


def run_pair(run: Path) -> str | None:
    """The model pair preset a run folder was trained on (its config.json), or None when unreadable."""
    try:
        return json.loads((run / "config.json").read_text())["env"]["pair"]
    except (OSError, KeyError, ValueError):
        return None


# -- a trained agent, read back for evaluation -------------------------------------------------------
# EnvConfig fields that decide what an agent sees and what its actions mean: an agent is evaluated with
# its run's values of these (the reward weights and quality term stay those of the evaluation).
AGENT_ENV_FIELDS = ("observation", "action", "fallback_values", "rollback_values", "max_draft_len", "prompt_tokens")


def choose_model(path: str | Path) -> tuple[Path, str]:
    """A model file as given, or in a run folder the policy selected on validation (``best_model.zip``,
    kept by the evaluation callback) when there is one, else the final ``model.zip``; and why."""
    path = Path(path)
    if not path.is_dir():
        return path, "the file given"
    best = path / "best_model.zip"
    if best.is_file():
        return best, "the best mean validation return during training"
    return path / "model.zip", "the final model: this run kept no best_model.zip"


def run_config_of(model_path: str | Path) -> RunConfig | None:
    """The config of the run a model file (or run folder) belongs to: ``config.json`` beside it, or above
    ``checkpoints/``; None for a model without one."""
    p = Path(model_path)
    for folder in (p, p.parent, p.parent.parent):
        if (folder / "config.json").is_file():
            return RunConfig.load(folder / "config.json")
    return None


def zip_algo(path: Path) -> str | None:
    """Which of DQN, SAC, PPO, A2C saved ``path``, from the attributes it saved (PPO and A2C load each other's
    files without complaint); None when it cannot be told."""
    try:
        data = load_from_zip_file(path, device="cpu", print_system_info=False)[0] or {}
    except Exception:  # noqa: BLE001 - not a readable SB3 zip: load_agent reports it
        return None
    for key, algo in (("exploration_fraction", "dqn"), ("target_entropy", "sac"), ("n_epochs", "ppo"),
                      ("gae_lambda", "a2c")):
        if key in data:
            return algo
    return None


def load_agent(path: str | Path, env: gym.Env):
    """An SB3 model (DQN, PPO, A2C or SAC) from a model file, refused with the reason when it is none of them
    or was trained for other observation or action spaces than ``env``'s (``ConfigError``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no model file at {path}")
    errors = []
    algo = zip_algo(path)
    for cls in [ALGO_CLASSES[algo]] if algo else ALGO_CLASSES.values():
        try:
            model = cls.load(path, device="cpu")
            break
        except Exception as err:  # noqa: BLE001 - SB3 raises several types for a zip of another algorithm
            errors.append(f"{cls.__name__}: {type(err).__name__}")
    else:
        raise ConfigError(f"{path} is not a DQN, PPO, A2C or SAC model.zip ({'; '.join(errors)})")
    if model.observation_space != env.observation_space or model.action_space != env.action_space:
        raise ConfigError(f"{path} was trained for observation space {model.observation_space} and action space "
                          f"{model.action_space}, but this env has {env.observation_space} and {env.action_space}: "
                          f"evaluate it with the env options it was trained with ({', '.join(AGENT_ENV_FIELDS)})")
    return model
