"""Replay buffers in checkpoints: the filled rows only, compressed, read back at full capacity (SB3's own files too)."""

from __future__ import annotations

import copy
import pickle
import zlib
from pathlib import Path

import numpy as np
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import ReplayBuffer

from agents.common.files import write_atomic
from agents.config import ConfigError

_BUFFER_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


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
