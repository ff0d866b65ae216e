"""Where bild-gym keeps what it builds or downloads: one cache folder, one function."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
MIN_FREE_MB = 1  # what the cache's disk must have free to be used (cost tables, references, replay trees: KBs each)


def cache_root() -> Path:
    """The bild-gym cache: ``$BILD_ENV_CACHE`` if set, else ``$XDG_CACHE_HOME/bild_env``, else ``~/.cache/bild_env``
    (not created)."""
    root = os.environ.get("BILD_ENV_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bild_env")
    return Path(root)


def cache_dir(*parts: str) -> Path:
    """Return (and create) a folder under the bild-gym cache (``cache_root``).

    A folder that cannot be made, in which nothing can be written (a read-only mount, no permission), or on a disk
    with under ``MIN_FREE_MB`` free, is a ``bild_env.command.Failure`` that names it and says what to do, before
    anything is computed to be kept there.
    """
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unusable(path, err.strerror or str(err)) from None
    if not os.access(path, os.W_OK):
        readonly = os.statvfs(path).f_flag & os.ST_RDONLY
        raise _unusable(path, "a read-only file system" if readonly else "no permission to write there")
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_MB * 2**20:
        raise _unusable(path, f"{free // 1024} KB free on its disk, under the {MIN_FREE_MB} MB it needs", "on another "
                        "disk, or free some space there")
    from bild_env.command import writing_into

    writing_into(cache_root(), "BILD_ENV_CACHE")  # a full or read-only disk met later in it: move the cache
    return path


def _unusable(path: Path, why: str, where: str = "you can write") -> Exception:
    from bild_env.command import Failure

    given = "BILD_ENV_CACHE" in os.environ
    now = f"it is now {os.environ['BILD_ENV_CACHE']}" if given else f"it is unset: the cache is {cache_root()}"
    return Failure(f"the cache folder {path} cannot be used ({why}): set BILD_ENV_CACHE to a folder {where} ({now})")


def digest(*parts: str, length: int = 16) -> str:
    """A file-name-safe key of ``parts`` (SHA-1 of the parts joined by "|", first ``length`` hex digits).

    Every on-disk cache names its files with it: cost models (pair and device), references (pair and
    length), replay trees (pair; prompt token ids at full length).
    """
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:length]


def prompt_key(prompt_ids) -> str:
    """The key of a prompt's token ids (references and replay trees are stored under it)."""
    return digest(",".join(map(str, prompt_ids)), length=40)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it (``.<name>.<pid>-<random>.tmp``) renamed over it: a
    reader sees the old file or the new one, never half of one; the temporary file is gone whatever happens."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def signature(path: Path) -> tuple[int, int, int]:
    """What tells one version of a file from another: (inode, size, mtime in ns); zeros when absent."""
    try:
        st = path.stat()
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def set_aside(path: Path, seen: tuple[int, int, int], lock=contextlib.nullcontext()) -> Path | None:
    """Move the damaged file ``path``, read as version ``seen`` (``signature``), to ``<name>.bad-<time>-<pid>`` beside
    it under ``lock``; None when another writer has replaced it since (whole: files are renamed into place). Raises
    what the move (or the lock) raises."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    with lock:
        if signature(path) != seen:
            return None
        os.replace(path, aside)
    return aside
