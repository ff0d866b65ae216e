"""One way every command fails: a known error is one line that says what to do, and an exit status.

Every entry point runs its ``main`` through ``run_command`` (``sys.exit(run_command("bench.batched", main))``):

* ``UsageError`` or ``UsageExit`` (a bad option or input: a count, a probability, a device, a path;
  ``DeviceError``, ``PairError`` and the agents' ``ConfigError`` are ones) prints ``<prog>: error: <message>`` and exits with status 2;
* ``Failure`` (a known failure that no option caused: a file that cannot be read or written) prints the same and
  exits with status 1;
* anything else is a bug: its stack trace is printed (Python's exit status 1);
* ``--debug`` (taken out of the arguments before ``main`` reads them) or ``BILD_DEBUG=1`` shows the stack trace of
  a known error too.

Checks that run before any work raise these: ``writable_file`` for an ``--out`` (which it also claims:
``claim_output``, one writer per file), ``check_options`` for counts,
probabilities and finite numbers, ``bild_env.models.device.usable_device`` for a ``--device``, and each command's own
option checks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEBUG_FLAG = "--debug"


class UsageError(ValueError):
    """A bad option or input; the message says what to change. A command exits with status 2."""


class Failure(RuntimeError):
    """A known failure that no option caused (a file that cannot be read or written); the message says what to do.
    A command exits with status 1."""


class UsageExit(SystemExit):
    """A ``UsageError`` raised where callers expect a ``SystemExit`` (argparse's way): its code is the message, and
    ``run_command`` exits with status 2 (a ``main`` called without it exits with 1, the message printed)."""


def run_command(prog: str, main: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv``: the command line's arguments without ``--debug``) and return its exit status: 0
    for a result that is no int, 2 for a ``UsageError``, 1 for a ``Failure`` (each a line on stderr, no trace)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args or os.environ.get("BILD_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        result = main(args)
    except (UsageError, Failure, UsageExit) as err:
        if debug:
            raise
        message = one_line(err).removeprefix("error: ")
        print(message if message.startswith(prog) else f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 1 if isinstance(err, Failure) else 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def one_line(err: BaseException) -> str:
    """An error's message on one line (its lines joined)."""
    return " ".join(str(err).split()) or type(err).__name__


def writable_file(path: str | Path | None, option: str = "--out", claim: bool = True) -> Path | None:
    """``path`` checked, before any work, as a file a command will write: not a folder, in a folder that exists or can
    be made and where this user can write (a ``UsageError`` naming ``option`` otherwise). With ``claim`` the file is
    also claimed for the rest of this process's life (``claim_output``): a second command given the same file while
    this one runs is refused at once. None stays None."""
    if path in (None, ""):
        return None
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name, e.g. {option} {path / 'results.json'}")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: cannot write into {path.parent}: {folder} is a file: give another path")
    if not _can_write_in(folder) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: cannot write into {folder} (no file can be made there): give another path")
    if claim:
        claim_output(path, option)
    return path


_CLAIMED: dict[Path, int] = {}  # lock files this process holds (their descriptors), until it exits


def claim_output(out: Path, option: str = "--out", lock: Path | None = None) -> None:
    """Hold a lock file beside ``out`` (``.<name>.lock``, or ``lock``) for the rest of this process's life
    (``flock``: freed when the process ends, even by a kill): a second command that would write ``out`` is refused at
    once, a ``UsageError`` naming the process that writes it, instead of both running and the first one's results
    silently replaced. The folder is made if it is missing (the file is to be written there)."""
    import fcntl

    out = Path(out)
    lock = Path(lock) if lock is not None else out.parent / f".{out.name}.lock"
    if lock in _CLAIMED:
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UsageError(f"{option} {out}: another command (pid {holder}) is writing its results there now: wait "
                         f"for it to end, or give another {option}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    if not _CLAIMED:
        import atexit

        atexit.register(release_outputs)
    _CLAIMED[lock] = fd


def release_outputs() -> None:
    """Give back every lock ``claim_output`` took (the files removed), once the results are written."""
    for lock, fd in list(_CLAIMED.items()):
        lock.unlink(missing_ok=True)
        os.close(fd)
        del _CLAIMED[lock]


def _can_write_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``: tried (permissions alone say nothing for root or a read-only mount)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_options(cfg: Any, at_least_one: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = (),
                  probabilities: tuple[str, ...] = ()) -> None:
    """A ``UsageError`` naming ``--the-option`` when a field of the dataclass instance ``cfg`` is out of its range:
    a count below 1 or 0, a probability outside [0, 1], or any float field NaN or infinite."""
    import math
    from dataclasses import fields

    def option(name: str) -> str:
        return "--" + name.replace("_", "-")

    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{option(f.name)} must be a finite number, got {value}")
    for name in at_least_one + at_least_zero:
        low = 1 if name in at_least_one else 0
        if getattr(cfg, name) < low:
            raise UsageError(f"{option(name)} must be at least {low}, got {getattr(cfg, name)}")
    for name in probabilities:
        if not 0 <= getattr(cfg, name) <= 1:
            raise UsageError(f"{option(name)} is a probability: give a number in [0, 1], got {getattr(cfg, name)}")


def parse_each(option: str, items, parse) -> list:
    """``parse`` of each of ``items`` (the values of ``option``, e.g. "--rules" or "tree_rules:"); a ValueError that
    names the option and says what ``parse`` said of the first bad one."""
    out = []
    for item in items:
        try:
            out.append(parse(item))
        except ValueError as err:
            raise ValueError(f"{option} {err}") from None
    return out
