"""Run folders: where a training run's files lie, and reading them back.

A run writes ``<log_dir>/<run_name>/``: ``config.json`` (``save_config``), TensorBoard events
(read back by ``summarize``), ``checkpoints/`` (``save_checkpoint``; names from ``checkpoint_paths``,
parsed by ``parse_checkpoint_name``: the model, the replay buffer of DQN and SAC with its filled rows
only, compressed (``save_replay_buffer``; ``prune_replay_buffers`` keeps the newest), and the resume
state of ``agents.resume``), ``evaluations.npz`` (``Evaluations``), ``best_model.zip`` with its step in
``best_model.json`` (``save_best_model``) and ``model.zip``. Every file is written whole or not at all
(a temporary file renamed). ``RunLock`` (``train.lock``) keeps a run folder to one process.

``find_run`` and ``intact_checkpoint`` (the newest checkpoint that loads, past truncated or garbled ones)
find what ``--resume`` continues from; ``discard_after`` then removes what a killed run wrote after it
(checkpoints, evaluations, best models of the branch thrown away). ``check_log_dir`` and
``check_new_run_dir`` fail early when a run cannot start. ``choose_model``, ``run_config_of`` and
``load_agent`` read a trained agent back for evaluation (``evaluate.py``, ``bench.headroom``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import platform
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import gymnasium as gym
import numpy as np
import stable_baselines3
import torch
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.save_util import load_from_zip_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

try:
    import fcntl
except ImportError:  # not on POSIX: run folders are not locked
    fcntl = None

from agents.algos import ALGO_CLASSES, algo_class, off_policy
from agents.config import ConfigError, RunConfig

CHECKPOINT_PREFIX = "dqn"  # checkpoints/<algo>_<steps>_steps.zip (and <algo>_replay_buffer_<steps>_steps.pkl), e.g. dqn_...
# SB3's CheckpointCallback names: <prefix>_<steps>_steps.zip (model), <prefix>_replay_buffer_<steps>_steps.pkl; and
# <prefix>_state_<steps>_steps.json (agents.resume). best_model_<steps>_steps.zip: the best models (prefix best_model)
_CHECKPOINT_NAME = re.compile(r"(?P<prefix>.+?)_(?:replay_buffer_(?P<buffer>\d+)_steps\.pkl|state_(?P<state>\d+)_steps\.json"
                              r"|(?P<model>\d+)_steps\.zip)")
BEST_PREFIX = "best_model"
LOCK_FILE = "train.lock"
_BUFFER_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
EVAL_TAGS = ("eval/mean_reward", "eval/bleu")  # summarize: by step
TRAIN_TAGS = ("bild/episode_reward", "bild/bleu", "replay/hit_rate")  # summarize: means of tenths


@dataclass(frozen=True)
class Checkpoint:
    """A saved model, its replay buffer (None for an on-policy algorithm) and its resume state (``agents.resume``;
    None in checkpoints of older runs, resumed with new episodes) after ``steps`` env steps."""

    model: Path
    replay_buffer: Path | None
    steps: int
    state: Path | None = None


@dataclass(frozen=True)
class CheckpointName:
    """What a checkpoint file's name says: its prefix, its step count, and its kind ("model", "replay_buffer", "state")."""

    prefix: str
    steps: int
    kind: str = "model"

    @property
    def replay_buffer(self) -> bool:
        return self.kind == "replay_buffer"


def parse_checkpoint_name(name: str) -> CheckpointName | None:
    """``<prefix>_<steps>_steps.zip``, ``<prefix>_replay_buffer_<steps>_steps.pkl`` or ``<prefix>_state_<steps>_steps.json``;
    None for other names."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    kind = next(k for k in ("buffer", "state", "model") if match.group(k) is not None)
    return CheckpointName(match.group("prefix"), int(match.group(kind)), "replay_buffer" if kind == "buffer" else kind)


def checkpoint_files(folder: str | Path) -> Iterator[tuple[Path, CheckpointName]]:
    """Every file in ``folder`` named as a checkpoint, with what its name says."""
    for path in Path(folder).glob("*_steps.*"):
        name = parse_checkpoint_name(path.name)
        if name is not None:
            yield path, name


def checkpoint_paths(run_dir: Path, steps: int, algo: str = CHECKPOINT_PREFIX) -> Checkpoint:
    """Names as SB3's CheckpointCallback writes them (with the algorithm's name as prefix), and the state's."""
    folder = run_dir / "checkpoints"
    buffer = folder / f"{algo}_replay_buffer_{steps}_steps.pkl" if off_policy(algo) else None
    return Checkpoint(folder / f"{algo}_{steps}_steps.zip", buffer, steps, folder / f"{algo}_state_{steps}_steps.json")


def run_algo(run_dir: Path) -> str:
    """The algorithm of the run in ``run_dir`` (its config.json; runs from before ``--algo`` trained a DQN)."""
    try:
        return RunConfig.load(run_dir / "config.json").train.algo
    except (OSError, ValueError, TypeError, KeyError):
        return CHECKPOINT_PREFIX


def checkpoints(run_dir: Path, algo: str | None = None) -> list[Checkpoint]:
    """Every checkpoint whose model (and replay buffer, for DQN and SAC) exist, newest (most steps) first.

    ``save_checkpoint`` writes the model last, so a checkpoint of this version with a model has its state too;
    ``state`` is None for checkpoints of older runs.
    """
    algo = algo or run_algo(run_dir)
    found = [checkpoint_paths(run_dir, name.steps, algo) for _, name in checkpoint_files(run_dir / "checkpoints")
             if name.prefix == algo and name.kind == "model"]
    found = [c if c.state.is_file() else Checkpoint(c.model, c.replay_buffer, c.steps) for c in found]
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
        loaders.append((checkpoint.replay_buffer, read_replay_buffer))
    if checkpoint.state is not None:
        loaders.append((checkpoint.state, read_state))
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
    candidates = (Path(run), log_dir / run)
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    for candidate in candidates:
        if candidate.is_dir():
            raise ConfigError(f"--resume {run!r}: {candidate} holds no config.json: that run stopped before it started, "
                              f"so there is nothing to resume; start it again (python train.py ... --run-name "
                              f"{candidate.name} --log-dir {candidate.parent}: an empty folder is reused)")
    raise ConfigError(f"--resume {run!r}: no run folder with a config.json at {run} or {log_dir / run}")


def check_new_run_dir(run_dir: Path) -> None:
    """Fail now when a new run cannot use ``run_dir``: another process holds it, it is a run already (continue it
    with --resume), or it holds other files. A folder with nothing but a stale lock file (a start killed before
    its config was written) is reused."""
    if not run_dir.exists():
        return
    check_not_in_use(run_dir)
    if (run_dir / "config.json").exists():
        raise ConfigError(f"{run_dir} exists already: continue it with --resume {run_dir}, or pick another --run-name")
    others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else [run_dir.name]
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise ConfigError(f"{run_dir} is no run folder of train.py (no config.json) but holds {shown}: delete it or "
                          "pick another --run-name")


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


# -- run lock --------------------------------------------------------------------------------------
class RunInUse(ConfigError):
    """Another process trains the run (its lock file says which)."""


class RunLock:
    """``<run>/train.lock``: held (``flock``, exclusive) by the one process that trains the run, with its pid, host,
    start time and command line in it. The kernel drops the lock when the process ends, however it ends, so a
    lock file left by a killed process holds nothing back. Not on NFS (flock is per host) nor off POSIX (no lock).

        with RunLock.acquire(run_dir):   # RunInUse at once when another process holds it
            ...
    """

    def __init__(self, run_dir: Path, fd: int | None) -> None:
        self.run_dir, self._fd = run_dir, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        if fcntl is None:
            return cls(run_dir, None)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunInUse(_in_use_message(run_dir)) from None
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the releasing process removed the file after this one opened it: lock the new one
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return cls(run_dir, fd)

    def release(self, remove_empty_folder: bool = False) -> None:
        """Unlock (and remove the lock file); with ``remove_empty_folder``, remove the run folder if nothing else is in it
        (a start that failed before its config was written)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                (self.run_dir / LOCK_FILE).unlink()
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        if remove_empty_folder:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # fails unless empty

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(run_dir: Path) -> dict | None:
    """What ``train.lock`` says of the process holding ``run_dir`` (pid, host, started, argv), or None when none holds it."""
    path = run_dir / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
    finally:
        os.close(fd)
    return None


def check_not_in_use(run_dir: Path) -> None:
    if lock_holder(run_dir) is not None:
        raise RunInUse(_in_use_message(run_dir))


def _in_use_message(run_dir: Path) -> str:
    holder = lock_holder(run_dir) or {}
    pid = holder.get("pid", "?")
    command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(holder.get("argv") or []))
    return (f"{run_dir} is in use by process {pid} on {holder.get('host', '?')} (since {holder.get('started', '?')}: "
            f"{command or '?'}): wait for it to end, or stop it (kill {pid}: it saves a checkpoint first) and resume "
            "the run then")


# -- checkpoints -------------------------------------------------------------------------------------
def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it: ``path`` is whole or as it was. A Ctrl-C
    or SIGTERM that arrives meanwhile acts once the file is written (``signals_held``): a ``KeyboardInterrupt``
    raised inside a writer such as ``zipfile`` would else end in that writer's own error."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with signals_held():
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM held back inside the block and delivered, in the order they came, at its end, to the
    handlers that were there before (a signal the process ignores stays ignored). In the main thread only, where
    Python runs signal handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) not in (signal.SIG_IGN, None)]
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in caught:
            signal.raise_signal(s)  # as if it came now: the handler before runs (a stop request, KeyboardInterrupt)


def save_checkpoint(model: BaseAlgorithm, run_dir: Path, algo: str, state: dict | None,
                    keep_replay_buffers: int = 0) -> Checkpoint:
    """The model, its replay buffer (DQN, SAC) and ``state`` (``agents.resume.capture``) after ``model.num_timesteps``.

    The model is written last: a checkpoint is complete when its model file exists. Then all but the newest
    ``keep_replay_buffers`` replay buffers are deleted (0: all kept).
    """
    checkpoint = checkpoint_paths(run_dir, model.num_timesteps, algo)
    checkpoint.model.parent.mkdir(parents=True, exist_ok=True)
    if state is not None:
        write_atomic(checkpoint.state, lambda f: f.write((json.dumps(state) + "\n").encode()))
    if checkpoint.replay_buffer is not None:
        save_replay_buffer(model.replay_buffer, checkpoint.replay_buffer)
    write_atomic(checkpoint.model, model.save)
    prune_replay_buffers(checkpoint.model.parent, keep_replay_buffers)
    return checkpoint if state is not None else Checkpoint(checkpoint.model, checkpoint.replay_buffer, checkpoint.steps)


def read_state(path: Path) -> dict:
    """A checkpoint's resume state (``agents.resume``)."""
    state = json.loads(Path(path).read_text())
    if not isinstance(state, dict) or "rng" not in state or "envs" not in state:
        raise ValueError("not a resume state")
    return state


class _Deflated:
    """An array pickled zlib-compressed; unpickled as a plain (writable) numpy array by ``_inflate``."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array)

    def __reduce__(self):
        return _inflate, (zlib.compress(self.array.tobytes(), 1), self.array.dtype.str, self.array.shape)


def _inflate(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(bytearray(zlib.decompress(data)), dtype=dtype).reshape(shape)


def save_replay_buffer(buffer: ReplayBuffer, path: Path) -> None:
    """``buffer`` pickled with only its filled rows, each array zlib-compressed inside the pickle.

    SB3 preallocates the whole capacity (``buffer_size``: 95 MB for the default DQN) and pickles it all;
    this writes what was filled (all of it once the buffer is full), compressed. ``pickle.load`` gives SB3's
    ``ReplayBuffer`` with arrays of the filled rows (``pos`` of them, or ``buffer_size`` when ``full``);
    ``read_replay_buffer`` gives it back at full capacity, and reads SB3's own files too.
    """
    filled = buffer.buffer_size if buffer.full else buffer.pos
    compact = copy.copy(buffer)
    for name in _BUFFER_ARRAYS:
        value = getattr(buffer, name, None)
        if isinstance(value, np.ndarray) and len(value) == buffer.buffer_size:
            setattr(compact, name, _Deflated(value[:filled]))
    write_atomic(path, lambda f: pickle.dump(compact, f, protocol=pickle.HIGHEST_PROTOCOL))


def read_replay_buffer(path: Path) -> ReplayBuffer:
    """A replay buffer at its full capacity, from ``save_replay_buffer``'s file or SB3's ``save_replay_buffer``'s."""
    with open(path, "rb") as f:
        buffer = pickle.load(f)
    if not isinstance(buffer, ReplayBuffer):
        raise TypeError(f"not an SB3 ReplayBuffer but a {type(buffer).__name__}")
    for name in _BUFFER_ARRAYS:
        value = getattr(buffer, name, None)
        if isinstance(value, np.ndarray) and len(value) < buffer.buffer_size:
            whole = np.zeros((buffer.buffer_size, *value.shape[1:]), dtype=value.dtype)
            whole[: len(value)] = value
            setattr(buffer, name, whole)
    return buffer


def load_replay_buffer(model: BaseAlgorithm, path: Path) -> None:
    """``model``'s replay buffer from ``path`` (what SB3's ``load_replay_buffer`` does, for both file formats)."""
    buffer = read_replay_buffer(path)
    mine = model.replay_buffer
    if (buffer.buffer_size, buffer.n_envs) != (mine.buffer_size, mine.n_envs):
        raise ConfigError(f"{path} holds a replay buffer of {buffer.buffer_size} rows x {buffer.n_envs} envs; the model "
                          f"needs {mine.buffer_size} x {mine.n_envs}")
    buffer.device = model.device
    model.replay_buffer = buffer


# -- evaluations and the best model -------------------------------------------------------------------
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
        """(step, mean return) of the best evaluation by ``EvalCallback``'s rule (the first to beat all before it)."""
        best = None
        for t, r in zip(self.timesteps, self.results):
            if best is None or float(np.mean(r)) > best[1]:
                best = (int(t), float(np.mean(r)))
        return best

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


def best_snapshot(run_dir: Path, steps: int) -> Path:
    return run_dir / "checkpoints" / f"{BEST_PREFIX}_{steps}_steps.zip"


def save_best_model(model: BaseAlgorithm, run_dir: Path, mean_reward: float) -> None:
    """A new best model (evaluated at ``model.num_timesteps``): ``checkpoints/best_model_<steps>_steps.zip``, then
    ``best_model.zip`` and ``best_model.json`` (its step and mean return), each written whole."""
    steps = int(model.num_timesteps)
    snapshot = best_snapshot(run_dir, steps)
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(snapshot, model.save)
    _use_best(run_dir, snapshot, steps, mean_reward)


def _use_best(run_dir: Path, snapshot: Path, steps: int, mean_reward: float) -> None:
    write_atomic(run_dir / "best_model.zip", lambda f: f.write(snapshot.read_bytes()))
    meta = {"step": steps, "mean_reward": mean_reward, "copy": str(snapshot.relative_to(run_dir))}
    write_atomic(run_dir / "best_model.json", lambda f: f.write((json.dumps(meta) + "\n").encode()))


def best_model_info(run_dir: Path) -> dict | None:
    """``best_model.json`` (step, mean_reward) of a run folder, or None (none, or an older run without one)."""
    try:
        return json.loads((run_dir / "best_model.json").read_text())
    except (OSError, ValueError):
        return None


def discard_after(run_dir: Path, steps: int, evaluations: Evaluations, say: Callable[[str], None]) -> None:
    """Before resuming at ``steps``: remove what the run wrote after it, on the branch the resume throws away.

    Checkpoint files of later steps (unreadable or incomplete, as the newest readable one is at ``steps``) and
    their temporary files go; ``evaluations.npz`` is rewritten with ``evaluations`` (those up to ``steps``), and
    ``best_model.zip`` is the best of them again (its copy under ``checkpoints/``). ``say`` reports each change.
    """
    folder = run_dir / "checkpoints"
    later = [path for path, name in checkpoint_files(folder) if name.steps > steps]
    later += [p for p in folder.glob("*.tmp-*")] + [p for p in run_dir.glob("*.tmp-*")]
    for path in later:
        path.unlink(missing_ok=True)
    if later:
        say(f"removed {len(later)} file(s) written after step {steps} (the branch this resume throws away): "
            + ", ".join(sorted(p.name for p in later)[:6]) + (", ..." if len(later) > 6 else ""))
    if evaluations.timesteps:
        evaluations.save(run_dir / "evaluations.npz")
    elif (run_dir / "evaluations.npz").exists():  # every evaluation was after the checkpoint
        (run_dir / "evaluations.npz").unlink()
    restore_best_model(run_dir, evaluations.best(), say)


def restore_best_model(run_dir: Path, best: tuple[int, float] | None, say: Callable[[str], None]) -> None:
    path, info = run_dir / "best_model.zip", best_model_info(run_dir)
    if best is None:
        for p in (path, run_dir / "best_model.json"):
            if p.exists():
                p.unlink()
                say(f"removed {p.name}: no evaluation up to this step")
        return
    steps, mean_reward = best
    if info is not None and info.get("step") == steps and path.is_file():
        return
    snapshot = best_snapshot(run_dir, steps)
    if snapshot.is_file():
        _use_best(run_dir, snapshot, steps, mean_reward)
        say(f"best_model.zip is the model of step {steps} again (mean return {mean_reward:.4f})")
    elif path.is_file() and zip_steps(path) != steps:  # an older run, without copies of its best models
        aside = path.with_name(f"best_model.discarded-{zip_steps(path)}-steps.zip")
        os.replace(path, aside)
        say(f"best_model.zip was the model of step {zip_steps(aside)}, after this checkpoint: moved aside to "
            f"{aside.name}; the next evaluation above {mean_reward:.4f} saves a new one")


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
AGENT_ENV_FIELDS = ("observation", "action", "fallback_values", "rollback_values", "max_draft_len", "prompt_tokens",
                    "score")


PRETRAINED = "pretrained"  # --model pretrained: the serving agent shipped with the package (its card: README.md there)


def pretrained_run() -> Path:
    """The shipped BiLD-Serve-v0 agent: a run folder (``config.json``, ``best_model.zip``, its card ``README.md``) in
    ``bild_env/assets/serve-agent``, trained by ``python train.py --env serve`` with the defaults."""
    from bild_env.paths import ASSETS

    return ASSETS / "serve-agent"


def choose_model(path: str | Path) -> tuple[Path, str]:
    """A model file as given, or in a run folder the policy selected on validation (``best_model.zip``,
    kept by the evaluation callback) when there is one, else the final ``model.zip``; and why. ``"pretrained"``
    (where no such file or folder exists here) is the shipped serving agent (``pretrained_run``)."""
    if str(path) == PRETRAINED and not Path(path).exists():
        path = pretrained_run()
    path = Path(path)
    if not path.is_dir():
        return path, "the file given"
    best = path / "best_model.zip"
    if best.is_file():
        info = best_model_info(path)
        at = f", evaluated at step {info['step']}" if info and "step" in info else ""
        return best, f"the best mean validation return during training{at}"
    return path / "model.zip", "the final model: this run kept no best_model.zip"


def run_config_of(model_path: str | Path) -> RunConfig | None:
    """The config of the run a model file (or run folder) belongs to: ``config.json`` beside it, or above
    ``checkpoints/``; None for a model without one. A ``ConfigError`` naming the file when it cannot be read."""
    p = Path(model_path)
    for folder in (p, p.parent, p.parent.parent):
        path = folder / "config.json"
        if path.is_file():
            try:
                return RunConfig.load(path)
            except (OSError, ValueError, TypeError) as err:  # ValueError: bad JSON, or a ConfigError of a bad value
                raise ConfigError(f"cannot read the run's config {path} ({type(err).__name__}: {err}): repair it, or "
                                  "move it away and give the env options the model was trained with") from err
    return None


def zip_steps(path: Path) -> int | None:
    """The ``num_timesteps`` an SB3 model file was saved at, or None when it cannot be read."""
    try:
        data = load_from_zip_file(path, device="cpu", print_system_info=False)[0] or {}
    except Exception:  # noqa: BLE001 - not a readable SB3 zip
        return None
    return data.get("num_timesteps")


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
