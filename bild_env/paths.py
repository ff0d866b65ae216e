"""Where bild-gym keeps what it builds or downloads: one cache folder, one function."""

from __future__ import annotations

import hashlib
import os
import shutil
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
