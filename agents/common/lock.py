"""``<run>/train.lock``: one process at a time trains a run folder, for both trainers.

The lock is ``filelock``'s (``flock`` on POSIX, ``msvcrt`` on Windows): the operating system drops it when the
process ends, however it ends, so a lock file left by a killed process holds nothing back. The holder writes its
pid, host, start time and command line into the file, and ``lock_holder`` reads them back for the message that
names it. Not across hosts on NFS (flock is per host).

    with RunLock.acquire(run_dir):   # RunInUse at once when another process holds it
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import filelock

from agents.config import ConfigError
from bild_env.command import named, writing_into

LOCK_FILE = "train.lock"


class RunInUse(ConfigError):
    """Another process trains the run (its lock file says which)."""


def _file_lock(path: Path, on_acquired=None) -> filelock.BaseFileLock:
    return filelock.FileLock(path, timeout=0, thread_local=False, fallback_to_soft=False, on_acquired=on_acquired)


class RunLock:
    """The held lock of one run folder (``acquire``); ``release`` unlocks it and removes the file."""

    def __init__(self, run_dir: Path, lock: filelock.BaseFileLock | None) -> None:
        self.run_dir, self._lock = run_dir, lock

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """The run folder (made if missing) locked by this process; ``RunInUse`` at once where another holds it; an
        ``OSError`` naming the lock file where it cannot be written (a full disk: the lock file and a folder made
        for it removed again)."""
        new = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        writing_into(run_dir)  # a full disk that names no file is looked for here too

        def write_holder(fd: int) -> None:
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)

        lock = _file_lock(run_dir / LOCK_FILE, write_holder)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise RunInUse(_in_use_message(run_dir)) from None
        except OSError as err:  # the holder could not be written (a full disk, a read-only one)
            cls(run_dir, lock).release(remove_empty_folder=new)
            raise named(err, run_dir / LOCK_FILE) from err
        return cls(run_dir, lock)

    def release(self, remove_empty_folder: bool = False) -> None:
        """Unlock (and remove the lock file); with ``remove_empty_folder``, remove the run folder if nothing else is in it
        (a start that failed before its config was written)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.run_dir / LOCK_FILE).unlink()
            self._lock.release()
            self._lock = None
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
    if not path.is_file():
        return None
    probe = _file_lock(path)
    try:
        probe.acquire()
    except filelock.Timeout:
        try:
            return json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
    except OSError:  # cannot be opened: nobody can hold it through this file
        return None
    probe.release()
    return None


def _in_use_message(run_dir: Path) -> str:
    holder = lock_holder(run_dir) or {}
    pid = holder.get("pid", "?")
    command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(holder.get("argv") or []))
    return (f"{run_dir} is in use by process {pid} on {holder.get('host', '?')} (since {holder.get('started', '?')}: "
            f"{command or '?'}): wait for it to end, or stop it (kill {pid}: it saves a checkpoint first) and resume "
            "the run then")
