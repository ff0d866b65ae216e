"""Files written whole or not at all, for both trainers' run folders.

``write_atomic`` writes into a temporary file beside the target (``<name>.tmp-<pid>``) and renames it; a kill leaves
the old file or the new one. ``stale_temporaries`` finds what a killed process left. ``signals_held`` defers Ctrl-C
and SIGTERM until a write is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from bild_env.command import machine_fault, named


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it: ``path`` is whole or as it was. A Ctrl-C
    or SIGTERM that arrives meanwhile acts once the file is written (``signals_held``): a ``KeyboardInterrupt``
    raised inside a writer such as ``zipfile`` would else end in that writer's own error. An ``OSError`` (a full
    disk, a read-only one; also one a writer raised its own error from) is raised naming ``path`` (a write's own
    names no file, or the temporary one), the temporary file removed."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with signals_held():
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except Exception as err:  # noqa: BLE001 - a writer (zipfile, torch) may raise its own error from an OSError
            fault = err if isinstance(err, OSError) else machine_fault(err)
            if fault is None:
                raise
            raise named(fault, path) from err
        finally:
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` written to ``path`` whole or not at all (``write_atomic``)."""
    write_atomic(Path(path), lambda f: f.write(text.encode()))


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



def stale_temporaries(run_dir: Path) -> list[Path]:
    """Temporary files (``*.tmp-<pid>``) a killed process left in the run folder or its checkpoints."""
    return [p for folder in (run_dir, run_dir / "checkpoints") for p in folder.glob("*.tmp-*")]
