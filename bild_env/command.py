"""One way every command fails: a known error is one line that says what to do, and an exit status.

Every entry point runs its ``main`` through ``run_command`` (``sys.exit(run_command("scripts.analysis.batched", main))``):

* ``UsageError`` or ``UsageExit`` (a bad option or input: a count, a probability, a device, a path;
  ``DeviceError``, ``PairError`` and the agents' ``ConfigError`` are ones) prints ``<prog>: error: <message>`` and exits with status 2;
* ``Failure`` (a known failure that no option caused: a file that cannot be read or written) prints the same and
  exits with status 1;
* a fault of the machine (an ``OSError`` of ``MACHINE_FAULTS``: no space left, a quota used up, a read-only file
  system, no permission; also where it is the cause of another error, e.g. a writer's) prints one line naming the
  path and what to do (``machine_fault``) and exits with status 1;
* Ctrl-C or SIGTERM (``sigterm_as_ctrl_c``: a ``KeyboardInterrupt`` too, so that ``finally`` blocks run and the
  ``--out`` locks are given back) prints one line and exits with status 130: a ``Stopped`` says what was kept and how
  to go on, any other that nothing was finished; training stops at its next checkpoint (``agents.common.callbacks``);
* anything else is a bug: its stack trace is printed (Python's exit status 1);
* ``--debug`` (taken out of the arguments before ``main`` reads them) or ``BILD_DEBUG=1`` shows the stack trace of
  a known error too.

Checks that run before any work raise these: ``writable_file`` for an ``--out`` (which it also claims:
``claim_output``, one writer per file; ``check_room``: a block really written there, and ``MIN_FREE_MB`` free),
``check_options`` for counts,
probabilities and finite numbers, ``bild_env.models.device.usable_device`` for a ``--device``, and each command's own
option checks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEBUG_FLAG = "--debug"
MACHINE_FAULTS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
                  errno.EROFS: "a read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "operation not permitted"}  # OSErrors that are the machine's, not a bug
MIN_FREE_MB = 1  # what an --out's disk must have free (results are JSON, tables and plots: KBs to hundreds of KBs)
PROBE_BYTES = 64 * 1024  # the block ``check_room`` writes and syncs where an --out goes (an empty file proves nothing)


class UsageError(ValueError):
    """A bad option or input; the message says what to change. A command exits with status 2."""


class Failure(RuntimeError):
    """A known failure that no option caused (a file that cannot be read or written); the message says what to do.
    A command exits with status 1."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, after the command kept what it had done: the message says what is kept and how to go on. A
    command exits with status 130."""


class UsageExit(SystemExit):
    """A ``UsageError`` raised where callers expect a ``SystemExit`` (argparse's way): its code is the message, and
    ``run_command`` exits with status 2 (a ``main`` called without it exits with 1, the message printed)."""


def run_command(prog: str, main: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv``: the command line's arguments without ``--debug``) and return its exit status: 0
    for a result that is no int, 2 for a ``UsageError``, 1 for a ``Failure`` or a fault of the machine, 130 for Ctrl-C
    (each a line on stderr, no trace)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args or os.environ.get("BILD_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        with sigterm_as_ctrl_c():
            result = main(args)
    except (UsageError, Failure, UsageExit) as err:
        if debug:
            raise
        message = one_line(err).removeprefix("error: ")
        print(message if message.startswith(prog) else f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 1 if isinstance(err, Failure) else 2
    except KeyboardInterrupt as err:
        if debug:
            raise
        print(f"{prog}: {stopped_message(err)}", file=sys.stderr, flush=True)
        return 130
    except Exception as err:
        fault = machine_fault(err)
        if fault is None or debug:
            raise
        print(f"{prog}: error: {machine_message(fault)}", file=sys.stderr, flush=True)
        return 1
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM stops like Ctrl-C inside the block: a ``KeyboardInterrupt("SIGTERM")``, so that what a command does on
    Ctrl-C (results kept, locks given back, the line of ``run_command``) it does for a scheduler's stop too. In the
    main thread only, where Python runs signal handlers; a SIGTERM the process ignores stays ignored."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_name(err: KeyboardInterrupt) -> str:
    """The signal that stopped a command: "SIGTERM" where the handler that raised ``err`` named it, else Ctrl-C's."""
    text = str(err.args[0]) if err.args else ""
    return text if text.startswith("SIG") else "SIGINT"


def stopped_message(err: KeyboardInterrupt) -> str:
    """The line a command stopped by ``err`` ends with: a ``Stopped``'s own, else that nothing was finished."""
    if isinstance(err, Stopped):
        return one_line(err)
    return f"stopped by {signal_name(err)} before it finished: run the same command again"


def machine_fault(err: BaseException | None) -> OSError | None:
    """The ``OSError`` of ``MACHINE_FAULTS`` that ``err`` is or was caused by (a writer such as ``zipfile`` or torch
    may raise its own error from it); None for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in MACHINE_FAULTS:
            return err
        err = err.__cause__ or err.__context__
    return None


def machine_message(err: OSError) -> str:
    """One line for a fault of the machine: what happened, where (the file the error names, else the folder this
    command writes into that shows the fault: ``_suspect``) and what to do (inside the cache: set BILD_ENV_CACHE)."""
    given = err.filename if err.filename not in (None, "") else err.filename2
    path = Path(os.fsdecode(given)) if isinstance(given, (str, bytes, os.PathLike)) else _suspect(err.errno)
    where = "" if path is None else f" at {path}"
    folder, variable = _moved_by(path)
    if err.errno in (errno.ENOSPC, errno.EDQUOT) and path is None:
        return (f"{MACHINE_FAULTS[err.errno]} on a disk this command writes to (its outputs, its run folder, the "
                "cache, the working folder): free some space, and run it again")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        elsewhere = f"set {variable} to a folder on another disk" if variable else "give a path on another disk"
        return (f"{MACHINE_FAULTS[err.errno]}{where} ({_free_words(path)} free there): free some space there, or "
                f"{elsewhere}, and run it again")
    if variable:
        todo = f"set {variable} to a folder you can write (it is {folder})"
    else:
        todo = "give a path you can write" + ("" if err.errno == errno.EROFS else ", or change its permissions")
    return f"cannot {'write' if err.errno == errno.EROFS else 'use'}{where}: {MACHINE_FAULTS[err.errno]}: {todo}"


def named(err: OSError, path: str | Path) -> OSError:
    """``err`` naming ``path`` (the file a write was for: a write's own error names no file, or a temporary one); to
    raise ``from err``."""
    if err.errno is None or err.filename == str(path):
        return err
    return type(err)(err.errno, err.strerror, str(path))


def writing_into(folder: str | Path, variable: str | None = None) -> None:
    """Note that this command writes into ``folder`` (a run folder; the cache, which the environment variable
    ``variable`` moves): a fault of the machine that names no file is looked for there too, and one inside it says to
    set ``variable`` (``machine_message``)."""
    _WRITING.setdefault(Path(folder), variable)


def _moved_by(path: Path | None) -> tuple[Path | None, str | None]:
    """The folder noted by ``writing_into`` that holds ``path`` and the variable that moves it; (None, None) if none."""
    for folder, variable in _WRITING.items():
        try:
            if variable and path is not None and path.resolve().is_relative_to(folder.resolve()):
                return folder, variable
        except (OSError, RuntimeError):
            continue
    return None, None


def _existing(path: Path) -> Path:
    """``path``, or its nearest folder above that exists."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def _free_words(path: Path) -> str:
    import shutil

    try:
        free = shutil.disk_usage(_existing(path)).free
    except OSError:
        return "? bytes"
    return f"{free / 2**20:.1f} MB" if free >= 2**20 else f"{free // 1024} KB"


def _suspect(code: int) -> Path | None:
    """Where an unnamed fault most likely is: of the folders this command writes into (claimed outputs, its run
    folder and the cache: ``writing_into``, the working folder), the fullest one for no space (where it has under
    ``MIN_FREE_MB`` free), the read-only or unwritable one otherwise."""
    import shutil

    folders = list(dict.fromkeys([*(lock.parent for lock in _CLAIMED), *_WRITING, Path.cwd()]))
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = {}
        for f in folders:
            try:
                free[f] = shutil.disk_usage(_existing(f)).free
            except OSError:
                continue
        fullest = min(free, key=free.get) if free else None
        return fullest if fullest is not None and free[fullest] < MIN_FREE_MB * 2**20 else None  # else: not known
    return next((f for f in folders if not os.access(_existing(f), os.W_OK)), None)


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
    check_room(folder, option, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: cannot write into {folder} (no file can be made there): give another path")
    if claim:
        claim_output(path, option)
    return path


_CLAIMED: dict[Path, int] = {}  # lock files this process holds (their descriptors), until it exits
_MADE: dict[Path, None] = {}  # folders claim_output made for its locks, deepest first (removed again if left empty)
_WRITING: dict[Path, str | None] = {}  # other folders this process writes into, and the variables that move them


def claim_output(out: Path, option: str = "--out", lock: Path | None = None) -> None:
    """Hold a lock file beside ``out`` (``.<name>.lock``, or ``lock``) for the rest of this process's life
    (``flock``: freed when the process ends, even by a kill): a second command that would write ``out`` is refused at
    once, a ``UsageError`` naming the process that writes it, instead of both running and the first one's results
    silently replaced. The folder is made if it is missing (the file is to be written there), and removed with the
    lock where the command ends having written nothing in it."""
    import fcntl

    out = Path(out)
    lock = Path(lock) if lock is not None else out.parent / f".{out.name}.lock"
    if lock in _CLAIMED:
        return
    made = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]  # deepest first
    lock.parent.mkdir(parents=True, exist_ok=True)
    _MADE.update((folder, None) for folder in made)
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
    for folder in list(_MADE):  # deepest first: a folder made for a lock and left empty goes with it
        try:
            folder.rmdir()
        except OSError:  # results were written there, or it is gone
            pass
        del _MADE[folder]


def check_room(folder: Path, option: str = "--out", path: Path | None = None) -> None:
    """Before any work, that results can be written into ``folder`` (an existing one), where ``option`` (``path``)
    puts them: a ``PROBE_BYTES`` block written and synced there, then removed (permissions alone say nothing for root
    or a read-only mount, and an empty file can be made on a full disk), and ``MIN_FREE_MB`` free on its disk. A
    ``UsageError`` where no file can be made there (give another path), a ``Failure`` where the disk is full."""
    import shutil
    import tempfile

    what = f"{option} {path if path is not None else folder}"
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise Failure(f"{what}: {MACHINE_FAULTS[err.errno]} at {folder} ({_free_words(folder)} free there): "
                          "free some space there, or give a path on another disk") from None
        raise UsageError(f"{what}: cannot write into {folder} (no file can be made there: "
                         f"{err.strerror or err}): give another path") from None
    free = shutil.disk_usage(folder).free
    if free < MIN_FREE_MB * 2**20:
        raise Failure(f"{what}: {_free_words(folder)} free at {folder}, under the {MIN_FREE_MB} MB its results may "
                      "take: free some space there, or give a path on another disk")


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


def check_counts(cfg: Any, least: dict[str, int], notes: dict[str, str] | None = None, optional: tuple = ()) -> None:
    """A ``UsageError`` naming ``--the-option`` for a count of the dataclass instance ``cfg`` that is no integer or
    below its ``least`` (field -> least value), with ``notes``' word on the option after it; a field in ``optional``
    may be None."""
    for name, low in least.items():
        value = getattr(cfg, name)
        if (value is not None or name not in optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                              or value < low):
            note = f": {notes[name]}" if notes and name in notes else ""
            raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}{note}")


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
